"""A degree's records on disk: events.jsonl (one line per record) + records.safetensors."""
from __future__ import annotations

import os

import torch

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
from tpdiag.records import completeness
from tpdiag.records.base_world import OWN_KINDS, base_dir, base_drop, base_problem
from tpdiag.records.paths import EVENTS, TENSORS, WORLD, world_file
from tpdiag.records.record_index import RECORD_FORMAT, check_event, check_steps, is_int, check_format
from tpdiag.records.record_index import read_index  # noqa: F401 - read from here by tests and the runner

MAX_DEGREE = 1024  # sanity bound on world.json's degree: shards are rebuilt by repeating/concatenating


def write(out_dir: str, stored: list[tuple[dict, torch.Tensor]], world_meta: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    from tpdiag.records import safetensors_stream

    # a tensor or a host-held record (probes/host_store.Captured), written one at a time
    tensors = {str(m["idx"]): _storable(t) for m, t in stored if t is not None}
    # Tensors first, index last: an index that exists always points at complete tensors.
    safetensors_stream.write(os.path.join(out_dir, TENSORS), tensors, metadata={"schema": "1"})
    io.write_jsonl(os.path.join(out_dir, EVENTS), [m for m, _ in stored])
    from tpdiag import __version__
    from tpdiag.records.hashing import HASH_VERSION

    # which lane mix made this record set's hashes (records/hashing.py), in which layout, by which tpdiag
    # (the manifest's version must be the same: integrity.py)
    io.write_json(world_file(out_dir, WORLD), {**world_meta, "hash_version": HASH_VERSION,
                                               "record_format": RECORD_FORMAT, "tpdiag": __version__})


def _storable(t):
    """safetensors has no complex128 (the float64 re-execution of a complex64 input: torchtitan's
    freqs_cis): stored as its float64 [..., 2] view, read back by _restore."""
    if t.dtype != torch.complex128:
        return t
    return torch.view_as_real((t if isinstance(t, torch.Tensor) else t.get()).contiguous())


def _restore(meta: dict, t: torch.Tensor) -> torch.Tensor:
    if meta.get("dtype") == "complex128" and t.dtype == torch.float64 and t.dim() and t.shape[-1] == 2:
        return torch.view_as_complex(t)
    return t


class RecordSet:
    """Read side. Tensors load lazily; a truncated or edited file is Inconclusive, never misread."""

    def __init__(self, out_dir: str, drop_kinds: tuple[str, ...] = ()):
        """drop_kinds: the set without these records, as a world that recorded none of them would
        have written it (runner/compare.py: an earlier pass's world that also recorded ops, read
        by a pass that records none): the rest keep their order and are numbered from 0 again,
        as such a world numbers them; their tensors are read by the numbers stored.

        A world whose config names a `records_base` (the own-input pass's reference: it wrote only
        its float64 records) is read as the whole set it stands for: the base world's records less
        base_drop's kinds, then its own, numbered on from there; each tensor read from the file it is in and
        checked against its own stored hash, the base proven the same world's same step first
        (base_problem)."""
        self.dir = out_dir
        epath = os.path.join(out_dir, EVENTS)
        self.events = io.read_jsonl(epath)
        self.world = io.read_json(world_file(out_dir, WORLD))
        if not isinstance(self.world, dict):
            raise Inconclusive(f"{world_file(out_dir, WORLD)}: not a JSON object")
        check_format(self.world, world_file(out_dir, WORLD))
        from tpdiag.records.hashing import hash_version

        self.hash_version = hash_version(self.world)
        degree = self.world.get("degree", 1)
        if not is_int(degree) or not 1 <= degree <= MAX_DEGREE:
            raise Inconclusive(f"{world_file(out_dir, WORLD)}: degree {degree!r} is not "
                               f"an integer in 1..{MAX_DEGREE}")
        for i, m in enumerate(self.events):
            check_event(m, i + 1, epath)
            if m.get("world", degree) != degree:
                raise Inconclusive(f"{epath}: line {i + 1}: world {m['world']!r} but world.json says "
                                   f"degree {degree} (edited or mismatched files)")
        n = self.world.get("n_records")
        if is_int(n) and n != len(self.events):
            # cut at a line boundary, events.jsonl still parses: only the count the writer put beside it
            # tells that records are gone (or were added)
            raise Inconclusive(f"{epath}: holds {len(self.events)} records but world.json says the run wrote "
                               f"{n} (truncated or edited after the run)")
        base = base_dir(out_dir, self.world)
        if base is None:
            check_steps(self.world, self.events, epath)
            completeness.backward_ran(self.world, self.events, epath)
        path = os.path.join(out_dir, TENSORS)
        if not os.path.isfile(path):
            raise Inconclusive(f"{path}: missing")
        try:
            from safetensors import safe_open

            self._f = safe_open(path, framework="pt")
            keys = set(self._f.keys())
            from tpdiag.records import checked

            # id(open file) -> the file's identity when opened (records/checked.py)
            self._idents = {id(self._f): checked.identity(path)}
        except Exception as e:
            raise Inconclusive(f"{path}: unreadable or truncated safetensors ({_line(e)})") from None
        missing = [str(m["idx"]) for m in self.events
                   if m.get("stored") != "hash" and str(m["idx"]) not in keys]
        if missing:
            raise Inconclusive(f"{path}: {len(missing)} records listed in {EVENTS} are missing "
                               f"(first: {missing[0]})")
        completeness.orphan_tensors(keys, self.events, path, EVENTS)
        self._stored: dict = {}  # idx -> the number its tensor is stored under, where they differ
        self._file: dict = {}  # idx -> the open file its tensor is in, where not this folder's
        self.base = None  # the base's RecordSet (a world with a records_base)
        if base is not None:
            self._union(base, epath)
        if drop_kinds and any(m["kind"] in drop_kinds for m in self.events):
            # renumbered only where a record was dropped: a world's idx may have gaps (an expert-parallel
            # block's rank-local records left out at gather), and diff.csv's idx is the stored one - the
            # gate re-derives it, so a reader that drops nothing must number as the compare did
            kept = [(i, m) for i, m in enumerate(self.events) if m["kind"] not in drop_kinds]
            stored, files = self._stored, self._file
            self._stored = {j: stored.get(m["idx"], m["idx"]) for j, (_, m) in enumerate(kept)}
            self._file = {j: files[m["idx"]] for j, (_, m) in enumerate(kept) if m["idx"] in files}
            self.events = [{**m, "idx": j} for j, (_, m) in enumerate(kept)]
        self.by_key = {}
        self._verified: set = set()  # idx of records whose stored hash was checked
        for m in self.events:
            if m["key"] in self.by_key:
                raise Inconclusive(f"{epath}: record {m['key']} listed twice")
            self.by_key[m["key"]] = m

    def _union(self, base: str, epath: str) -> None:
        """The base world's records (less base_drop's kinds) first, then this folder's own (OWN_KINDS only)."""
        other = [m["key"] for m in self.events if m["kind"] not in OWN_KINDS]
        if other:
            raise Inconclusive(f"{epath}: record {other[0]} is of a kind a world reading its other records from "
                               f"{base} does not write (edited or mismatched files)")
        top = io.read_json(world_file(base, WORLD))
        why = base_problem(self.world, top, base) if isinstance(top, dict) else f"its base {base} has no world.json"
        if why:
            raise Inconclusive(f"{world_file(self.dir, WORLD)}: {why}")
        below = RecordSet(base, drop_kinds=base_drop(self.world["config"], top["config"]))
        if below.world != top:
            raise Inconclusive(f"{world_file(base, WORLD)}: changed while read (read it again)")
        if below.hash_version != self.hash_version:
            raise Inconclusive(f"{world_file(self.dir, WORLD)}: hash version {self.hash_version!r} but its base "
                               f"{base} hashed with {below.hash_version!r} (mismatched files)")
        nb = len(below.events)
        self._idents.update(below._idents)
        self._file = {i: below._f for i in range(nb)}
        self._stored = {i: below._stored.get(i, i) for i in range(nb)}
        self._stored.update({nb + m["idx"]: m["idx"] for m in self.events})
        self.events = below.events + [{**m, "idx": nb + m["idx"]} for m in self.events]
        check_steps(self.world, self.events, epath)
        completeness.backward_ran(self.world, self.events, epath)
        self.base = below

    @property
    def hash_only(self) -> bool:
        return any(m.get("stored") == "hash" for m in self.events)

    def tensor(self, meta: dict, verify: bool = True) -> torch.Tensor:
        """The record's stored tensor, checked against its index (dtype, shape) and, unless
        verify=False (then the caller checks it: verify() or vouch()), its stored hash."""
        if meta.get("stored") == "hash":
            raise Inconclusive(f"{self.dir}: record {meta['key']} was captured as a hash only "
                               "(--capture hash); rerun with --capture full for its values")
        t = self._stored_tensor(meta)
        # The stored tensor must be what the index says it is: an edited header or index that
        # points a record at another tensor is caught here, not compared as if it were the record.
        self._check_stored(meta, str(t.dtype).replace("torch.", ""), list(t.shape))
        if verify:
            self.verify(meta, t)
        return t

    def _check_stored(self, meta: dict, dtype: str | None, shape: list) -> None:
        """dtype None: a safetensors dtype code this tpdiag does not name (only the shape is checked)."""
        want = list(meta["local_shape"])
        if meta.get("stored") == "stacked":
            want = [meta["world"], *want]
        if (dtype is not None and dtype != meta["dtype"]) or shape != want:
            raise Inconclusive(f"{self.dir}: record {meta['key']} is stored as {dtype or '?'}{shape}, its index "
                               f"says {meta['dtype']}{want} (edited or mismatched files)")

    def check_every_record(self, need_hash: bool = True) -> None:
        """Every stored record is what its index says - its dtype and shape from the file's header, its
        bytes by its stored hash: the check for a record set nobody re-diffs (a second pass's worlds,
        records/integrity.py), and the records a re-diff never read (diff/recheck.verify: a decode or
        micro-batch configuration's reference's backward, which nothing is compared with). Its tensor
        file swapped for another world's, or its index for another's, fails the header; a value edited
        inside the file, its header intact, fails only the hash (the second pass's float64 verdicts stood
        on bytes nobody read again: red team hred10). need_hash: a stored record without a hash is refused
        (a compare world's: every one has its hash) rather than passed unchecked."""
        from tpdiag.records.safetensors_stream import torch_dtype_name

        for m in self.events:
            if m.get("stored") == "hash" or m["idx"] in self._verified:
                continue  # (read and checked already: the re-diff's records, recheck.verify)
            try:
                f, name = self._slot(m["idx"])
                s = f.get_slice(name)
                shape, code = list(s.get_shape()), s.get_dtype()
            except Exception as e:
                raise Inconclusive(f"{self.dir}: record {m['key']} unreadable ({_line(e)})") from None
            if m.get("dtype") == "complex128" and code == "F64" and shape[-1:] == [2]:
                code, shape = None, shape[:-1]  # _storable's view (no C128 code to name)
            try:
                self._check_stored(m, torch_dtype_name(code) if code else "complex128", shape)
            except Inconclusive:
                # Some records' index shape is not their stored one (an op's per-call pieces of a
                # data-dependent shape, seen in a micro-batch run's ops pass): the bytes are then the
                # run's own when they are what its hash says - another world's tensor never is.
                if not self._own_bytes(m):
                    raise
                continue
            if m.get("stored_hash") is None:
                if not need_hash:
                    continue  # verify()'s rule: a record set written without hashes has none to check
                # a compare world stores every tensor with its hash (runner/gather.py): one without was edited
                raise Inconclusive(f"{self.dir}: record {m['key']} has no stored hash, so its bytes cannot be "
                                   "checked (edited after the run)")
            self.verify(m, self._stored_tensor(m))

    def _own_bytes(self, meta: dict) -> bool:
        """Whether the record's stored bytes are what its stored hash says (verify(), as a yes/no)."""
        if meta.get("stored_hash") is None or not self.known_hashes():
            return False
        try:
            self.verify(meta, self._stored_tensor(meta))
        except Exception:  # noqa: BLE001 - unreadable or another tensor: not the run's bytes
            return False
        return True

    def _stored_tensor(self, meta: dict) -> torch.Tensor:
        """The record's tensor as its file holds it, in its own dtype (a complex128 record is stored as
        its float64 view: _storable), unchecked; unreadable is Inconclusive."""
        try:
            f, name = self._slot(meta["idx"])
            return _restore(meta, f.get_tensor(name))
        except Exception as e:
            raise Inconclusive(f"{self.dir}: record {meta['key']} unreadable ({_line(e)})") from None

    def _slot(self, idx: int):
        """(the open file a record's tensor is in, the number it is stored under there)."""
        return self._file.get(idx, self._f), str(self._stored.get(idx, idx))

    def known_hashes(self) -> bool:
        """Whether this set's stored hashes are of a lane mix this tpdiag computes."""
        from tpdiag.records.hashing import MIXES

        return self.hash_version in MIXES

    def verify(self, meta: dict, t: torch.Tensor) -> None:
        """The record's tensor (as tensor() read it) is what the run stored: its hash."""
        want_hash = meta.get("stored_hash")
        if want_hash is not None and meta["idx"] not in self._verified:
            from tpdiag.records.hashing import MIXES, tensor_hash

            if not self.known_hashes():
                raise Inconclusive(f"{self.dir}: world.json names hash version {self.hash_version!r}, "
                                   f"not one this tpdiag knows ({MIXES}): edited, or a newer tpdiag's run")
            # the same bytes of the same file, checked by another set of this compare (the
            # own-input diff's sets over the region pass's files): not hashed again
            if self.checked_before(meta):
                self.vouch(meta)
                return
            if tensor_hash(t, self.hash_version) != want_hash:
                raise Inconclusive(f"{self.dir}: record {meta['key']} does not match its hash "
                                   "(the tensor file was edited after the run)")
            self.vouch(meta)

    def _checked_key(self, meta: dict):
        """The record's stored tensor as records/checked.py names it (None: never counted as checked)."""
        from tpdiag.records import checked

        f, name = self._slot(meta["idx"])
        return checked.key(self._idents.get(id(f)), name, meta.get("stored_hash"), self.hash_version)

    def checked_before(self, meta: dict) -> bool:
        """Whether this set, or another set of this compare over the same file, checked the
        record's stored tensor against its stored hash (records/checked.py)."""
        from tpdiag.records import checked

        return meta["idx"] in self._verified or checked.seen(self._checked_key(meta))

    def vouch(self, meta: dict) -> None:
        """Count the record's tensor as checked (verify(), or the pair check in diff/engine.py):
        the file is mapped read-only for this set's life, so a record read again (bounds,
        oracle, report) is the bytes just checked. Other sets of this compare over the same file
        count it too (records/checked.py)."""
        from tpdiag.records import checked

        self._verified.add(meta["idx"])
        if meta.get("stored_hash") is not None and self.known_hashes():
            checked.add(self._checked_key(meta))


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
