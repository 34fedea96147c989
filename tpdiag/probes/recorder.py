"""Per-rank record stream: every tensor a probe sees, in execution order, as local shards.

A record is (meta, tensor). DTensors are stored as their local shard plus the placement, so
the gather step can rebuild the whole tensor without a collective inside a hook.

Hash mode (hash-first capture) keeps no tensor: each record's order-aware lanes and float64
statistics are computed on the device from the shard and its place in the whole tensor, and the
tensor is released at once - no copy, no host transfer, nothing that keeps the autograd graph
alive. Only the small outputs every summary reads (batch, logprobs, loss, grad norm) stay whole.
"""
from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tpdiag.base.dtensors import local_of, placement_label
from tpdiag.base.sparse import layout_name, strided
from tpdiag.probes import spans as _spans
from tpdiag.probes import stream as _stream
# take_lanes, is_stale: importable from here too, as the tests and benchmarks import them
from tpdiag.probes.hash_place import HashPlacing, _same, _unpadded, is_stale, take_lanes  # noqa: F401
from tpdiag.probes.rows import _DTYPE_NAMES, dtype_name, materialise
from tpdiag.records.keys import record_key

PHASES = ("init", "forward", "loss", "backward", "optimizer")


_PARAMETER = torch.nn.Parameter
# TPDIAG_DECODE_SPANS=0: every decode call's record through hash_piece (A/B of probes/spans.py)
_SPANS = [os.environ.get("TPDIAG_DECODE_SPANS", "1") != "0"]


# Kept whole even in hash mode: small, and every summary reads them (logprob error, loss drift).
KEEP_WHOLE = ("batch", "logprobs", "loss", "grad_norm", "oracle")


@dataclass
class Recorder(HashPlacing):
    step: int = 0
    phase: str = "init"
    # (meta, tensor) per record in stream order: `records` (a property, below) - the list, with
    # the pending rows of hash mode's fast path made into metas first
    _records: list = field(default_factory=list)
    # records made since `records` was last read: a hash-mode record of a plain tensor at TP=1
    # as a compact row (probes/rows.py), any other as its (meta, tensor) pair (host time per
    # record: docs/benchmarks.md, "Probe cost in hash mode")
    _rows: list = field(default_factory=list)
    # (meta, its private copy) of records kept whole whose hash is still to be computed
    _unhashed: list = field(default_factory=list)
    _calls: dict = field(default_factory=dict)
    enabled: bool = True
    # an oracle re-execution is running (probes/float64.py): module hooks neither record nor
    # count calls, so the real run's call indices stay its own
    in_oracle: bool = False
    oracle_notes: dict = field(default_factory=dict)  # oracle key -> {why | discrete} (float64.py)
    # the own-input pass's: label -> oracle key -> {why | discrete | params} (oracle_hooks.record_own_oracles)
    oracle_notes_own: dict = field(default_factory=dict)
    # seconds spent in float64 re-executions (the world's `float64_s`: where a second pass's time goes)
    oracle_s: float = 0.0
    hash: bool = True
    stack: list = field(default_factory=list)  # modules whose forward is running (op attribution)
    stack_calls: list = field(default_factory=list)  # ... and the call of each (an op's key: op#C)
    mode: str = "full"                          # full | hash
    fingerprint: dict | None = None             # the step's final values' hashes (runner/fingerprint.py)
    decode_check: tuple | None = None           # (positions, hash of their logits): runner/worker.py
    # step -> the floating buffers a micro-batch's forward wrote before a later micro-batch of the
    # same step ran (runner/step.py): that piece read them, the whole batch's one call did not
    piece_state: dict = field(default_factory=dict)
    ties_broken: list = field(default_factory=list)  # tied weights the plan split (world.json's own field)
    # parameter -> the user's grad hooks the plan's new parameter lacks (models/grad_hooks.py; world.json's own)
    hooks_dropped: dict = field(default_factory=dict)
    # parameter -> whether the user's grad hooks on it changed its grad (TP=1 worlds; world.json's own)
    hook_effect: dict = field(default_factory=dict)
    # the parameters still carrying the user's grad hooks after the plan (TP > 1 worlds; world.json's own)
    hooks_kept: list = field(default_factory=list)
    # weight use -> why the fixes' fp32 carry left it the stock grad (kernels/grad_carry.site; world.json's own)
    not_carried: dict = field(default_factory=dict)
    # {"steps": [k...]} - the later steps that started from the reference's state (runner/anchor.py),
    # or {"steps": [], "refused": why}; None: not asked (world.json's own `anchor`)
    anchor: dict | None = None
    # the model's logits hold a padded vocab (Megatron's make_vocab_size_divisible_by): {"vocab": real
    # ids, "local": this rank's width} (world.json's own field; records/layout.py vocab_padded)
    vocab_padding: dict | None = None
    # module_probes' lookup while its hooks are in: tensor -> names of the modules whose output it
    # is (or views), so a forward's logits name the modules that produced them (runner/piece.py)
    producers: object = None
    per_rank_params: int = 0                    # plain parameters not one replica (runner/per_rank.py)
    world: int = 1
    rank: int = 0
    # hash mode at TP > 1: each record's whole shape at the reference (TP=1), which says where
    # an unmarked shard (a plain local tensor) sits in the whole tensor
    ref_shapes: dict = field(default_factory=dict)
    lanes: list = field(default_factory=list)   # hash mode: per record its HashBuffer row, or None
    hashbuf: object = None
    # hash mode: id(tensor) -> (weakref, version, layout, slot) of the last record of that tensor.
    # A module's input is usually another's output, nested modules share outputs: the same
    # tensor, unchanged, under several keys is hashed once (its row shared).
    _hashed: dict = field(default_factory=dict)
    _piece_hashed: dict = field(default_factory=dict)  # the same inside pieces (probes/pieces.py)
    # module_probes' walk of each probed model (by id), read by record_params inside the block
    _walks: dict = field(default_factory=dict)
    # full mode: records stream to host memory (probes/stream.py), spilled here past the budget
    spill_dir: str | None = None
    host_store: object = None
    # a micro-batched step (runner/micro.py): the piece of the batch now running (None: the whole
    # batch), how many there are, and per record key the reference's size of dim 0 - whether a
    # piece's record is a slice of the whole along the batch (merged at the step's end:
    # probes/pieces.py) or the same per-call value in every piece
    piece: int | None = None
    n_pieces: int = 1
    piece_ref: dict = field(default_factory=dict)
    # a decode world (runner/decode.py): the piece is positions [start, stop) of `total` along the
    # sequence; piece_ref then holds the reference's whole shape per key, which says the dim
    piece_span: tuple | None = None
    # decode calls' records that grew call by call (pieces.grows): key -> calls left out, and each key's
    # shape at the call before
    piece_varying: dict = field(default_factory=dict)
    piece_shapes: dict = field(default_factory=dict)
    piece_memo: dict = field(default_factory=dict)  # pieces.place's answers, per key and shapes
    piece_plans: dict = field(default_factory=dict)  # spans.add_span's, per key and shapes
    piece_geoms: dict = field(default_factory=dict)  # ... and a number per place they hash at
    span_rows: dict = field(default_factory=dict)  # ... and per key a cell: its row, calls' slots
    # a decode run of the first n of the reference's L positions (runner/prefix.py): (n, L)
    piece_prefix: tuple | None = None
    # ... and its prefill reference: key -> (sequence dim, rows, L) of the records to cut to the
    # first prefix_n positions
    prefix: dict | None = None
    prefix_n: int = 0
    # record only these kinds (None: every kind): the own-input pass's reference, whose other
    # records are the region pass's reference's (WorldConfig.records_base)
    only_kinds: tuple | None = None

    @property
    def piece_whole(self) -> int | None:
        return self.piece_prefix[1] if self.piece_prefix else None

    def begin_piece(self, k: int, n: int, span: tuple | None = None) -> None:
        """Piece k of n starts: call indices count from 0 again, so piece k's call 0 of a module
        is the slice of the reference's call 0 (cleared in place: module_probes holds the dict).
        span: (start, stop, total) positions of a decode call (None: a micro-batch)."""
        self.piece, self.n_pieces, self.piece_span = k, n, span
        self._piece_hashed.clear()  # a row is shared within one piece only
        for key in [key for key in self._calls if key[0] == self.step]:
            del self._calls[key]

    def end_pieces(self) -> None:
        self.piece, self.piece_span = None, None
        for cell in self.span_rows.values():
            cell[0] = None

    def call_index(self, module: str) -> int:
        key = (self.step, self._phase, module)
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        return n

    def forget(self, tensors) -> None:
        """These tensors were written in place without a version bump (probes/collectives.py):
        their next record is copied or hashed anew."""
        store = self.host_store
        for t in tensors:
            self._hashed.pop(id(t), None)
            self._piece_hashed.pop(id(t), None)
            if store is not None:
                store.seen.pop(id(t), None)

    def add(self, kind: str, module: str, name: str, t: torch.Tensor, *, call: int = 0,
            phase: str | None = None, layout: str | None = None, style: str | None = None,
            cls: str | None = None):
        """Record t; returns the record (its meta, or a pending row: `extras` gives the dict
        later keys go in), or None when nothing was recorded."""
        if not self.enabled or not isinstance(t, torch.Tensor):
            return None
        if self.only_kinds is not None and kind not in self.only_kinds:
            return None
        if phase is None:
            phase = self._phase
        sparse = layout_name(t)
        if sparse is not None:
            # a sparse grad (nn.Embedding(sparse=True)) is recorded as the dense tensor it stands for,
            # coalesced as its optimizer reads it (base/sparse.py), its layout in the meta: judged as any other
            with self._paused():
                t = strided(t)
        step = self.step
        if self.prefix is not None:
            cut = self.prefix.get(record_key(step, phase, module, kind, call, name))
            if cut is not None and t.dim() > cut[0] and t.shape[cut[0]] == cut[1] * cut[2]:
                from tpdiag.records.layout import narrow_positions

                t = narrow_positions(t, cut[0], cut[1], self.prefix_n)
        mode = self.mode
        # Host time per record is what a small step pays for its probes (~1000 records, docs/
        # benchmarks.md "Probe cost in hash mode"). A plain tensor (or Parameter) at TP=1 in hash
        # mode, most records, is a whole tensor: a compact row now, its meta (key, shapes) built when
        # `records` is read; hashed once while unchanged (t's version counter: a detached
        # tensor shares it), queued as itself (HashBuffer detaches where it runs torch ops).
        # Its entry in _hashed is compact (one counter, the shape): _same reads it as the
        # (counters, place) pair the general path keeps. Op records take the general path: the
        # op probe records inside the dispatch, where a detached tensor has a counter of its own
        # and an in-place op's bump is still to come (`git show d055ef2:docs/benchmarks.md`, "Host work per
        # record, session 8").
        tt = type(t)
        # a decode call's record (probes/spans.py: planned once per key, ~450 a call)
        if self.piece_span is not None and tt is torch.Tensor and mode == "hash" and _SPANS[0] \
                and kind not in KEEP_WHOLE and kind != "op" and kind != "param_grad":
            row = _spans.add_span(self, kind, module, name, t, call, phase, layout, style, cls)
            if row is not False:
                return row
        if (tt is torch.Tensor or tt is _PARAMETER) and mode == "hash" and self.world == 1 \
                and kind not in KEEP_WHOLE and kind != "op" and self.piece is None and sparse is None:
            shape = t.shape
            dtype = t.dtype
            version = t._version
            seen = self._hashed.get(id(t))
            if seen is None or seen[0]() is not t or not (
                    seen[1] == version and seen[2] == shape if type(seen[1]) is int
                    else _same(seen, t, (version, version), (None, None, 0, list(shape)))):
                hb = self.hashbuf
                if hb is None:
                    from tpdiag.kernels.hash_buffer import HashBuffer

                    hb = self.hashbuf = HashBuffer(t.device)
                # the hash's own torch ops are not records (op probe)
                self.enabled = False
                try:
                    slot = hb.add_whole(t, shape, dtype, version)
                finally:
                    self.enabled = True
                self._hashed[id(t)] = (weakref.ref(t), version, shape, slot)
            else:
                slot = seen[3]
            self.lanes.append(slot)
            # the fields of probes/rows.py, in its order
            row = [step, phase, module, kind, call, name, layout, style, cls, dtype, shape, None]
            self._rows.append(row)
            return row
        if tt is torch.Tensor:
            label, local = None, t.detach()
        else:
            label = placement_label(t)
            local = local_of(t).detach()
        dtype = local.dtype
        key = record_key(step, phase, module, kind, call, name)
        meta = {
            "idx": len(self._records) + len(self._rows), "step": step, "phase": phase,
            "module": module, "kind": kind, "call": call, "name": name,
            "placement": layout if layout is not None else label, "style": style,
            "cls": cls, "dtype": _DTYPE_NAMES.get(dtype) or dtype_name(dtype),
            "local_shape": list(local.shape), "key": key,
        }
        if sparse is not None:
            meta["sparse"] = sparse
        if self.piece is not None:
            meta["piece"] = self.piece
            if self.piece_span is not None and not (mode == "hash" and kind not in KEEP_WHOLE):
                from tpdiag.probes.pieces import grows, place

                where = place(self, key, local, list(t.shape))
                meta["piece_dim"] = where[0] if where is not None else None
                if where is not None and where[3] > 1:
                    meta["piece_fold"] = where[3]  # rows of B sequences, flat (pieces.place)
                if where is None and mode == "full" and grows(self, key, local):
                    return None
            if mode == "hash" and kind not in KEEP_WHOLE:
                from tpdiag.probes.pieces import hash_piece

                return hash_piece(self, meta, t, local)
        if mode == "hash" and kind not in KEEP_WHOLE:
            layout_, full, dim, size, offset = self._hash_layout(t, local, key, label)
            meta["hash_layout"], meta["full_shape"] = layout_, full
            where = (dim, size, offset, full)
            # both counters: an in-place op on a DTensor bumps the wrapper's, not its local's
            version = (t._version, local._version)
            seen = self._hashed.get(id(t))
            if _same(seen, t, version, where):
                slot = seen[3]
            elif layout_.startswith("strided:"):
                slot = self._hash_strided(t, local, layout_)
            else:
                slot = self._hash(_unpadded(local, dim, size, offset), dim, size, offset, t)
                self._hashed[id(t)] = (weakref.ref(t), version, where, slot)
            self.lanes.append(slot)
            self._rows.append((meta, None))
            return meta
        if mode == "full":  # copied to the host in stream order (probes/stream.py)
            return _stream.record_full(self, meta, t, local)
        # A copy: later in-place updates (optimizer, inplace activations) must not rewrite history.
        local = local.clone(memory_format=torch.contiguous_format)
        if self.hash:
            # this rank's shard's hash, computed on its device when `records` is read: the copy
            # is the record's own, unchanged until then, and the hash's host sync leaves the step
            meta["hash"] = None
            self._unhashed.append((meta, local))
        self.lanes.append(None)
        self._rows.append((meta, local))
        return meta

    @contextmanager
    def _paused(self):
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was


def _get_phase(self) -> str:
    return self._phase


def _set_phase(self, phase: str) -> None:
    # A new phase may change recorded tensors in place (the optimizer phase clips grads, steps
    # params): queued hashes run first.
    if self.__dict__.get("hashbuf") is not None:
        self.hashbuf.flush()
    self._phase = phase


Recorder.phase = property(_get_phase, _set_phase)  # after @dataclass: its __init__ sets it


def _get_records(self) -> list:
    if self._rows:
        materialise(self._records, self._rows)
    if self._unhashed:
        from tpdiag.records.hashing import tensor_hash

        with self._paused():
            for meta, local in self._unhashed:
                meta["hash"] = tensor_hash(local)
        self._unhashed.clear()
    return self._records


Recorder.records = property(_get_records)
