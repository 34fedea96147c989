"""Where hash mode's records go: a row of lanes and statistics per record, on the device, and
the queue that hashes many records in one launch.

A step has ~1000 records and the host time to launch one small kernel each was most of what the
probes cost (`python -m benchmarks probes overhead`). So a record whose tensor the Triton kernel takes is
queued - a reference to its words, their version counter, a row of launch parameters - and the
queue is hashed in one launch per kind of record (shared constexprs) when it holds BATCH records
or cap_bytes() of tensors, when the recorder's phase changes, and before any row is read.

Deferring is exact only if the tensor is unchanged until the launch. Holding the reference keeps
its memory from being reused; an in-place update shows in its version counter, checked at the
launch: such a record is not hashed but marked STALE (no evidence, never a false match).
tpdiag's step moves to a new phase before it changes recorded tensors in place (gradient
clipping, the optimizer), which flushes the queue first. TPDIAG_HASH_BATCH=1: one launch per
record, at once.
"""
from __future__ import annotations

import struct

import torch

from tpdiag.kernels import record_hash as rh
from tpdiag.kernels import record_hash_batch as rb

# The cap bounds the memory the queue keeps alive. Most queued tensors are alive anyway
# (activations kept for backward); what it keeps alive longer is bounded by the cap, here also by
# 1% of the device's memory. Each launch costs the host ~0.1-0.2 ms inside a step (its table, the
# launch, the queue's checks): 1 GiB against 256 MiB took 3-10 ms off llama-1b's step at 8 x 4096
# in two runs (at 1 x 2048 the two runs disagreed), peak memory +0.0% (`probes overhead`, hash
# against hash-cap256m; `git show d055ef2:docs/benchmarks.md`, "Session 12"). TPDIAG_HASH_CAP_MB overrides.
CAP_BYTES = 1 << 30
CAP_FRACTION = 100  # at most 1 / CAP_FRACTION of the device's memory
RING = 32  # launch tables in flight
RING_GROUP = 4  # table slots per completion event (an event record costs ~5 us of host time)
DEFER_BYTES = 64 << 10  # a record off the Triton path up to this size is hashed at take()
DEFER_CAP = 16 << 20    # ... while the copies held for it stay under this
STALE = -1  # in a row's non-finite count: the tensor changed in place before it was hashed
# (shape, dtype, dim, full, offset, data pointer % 16) -> (launch key, table row after the pointer
# and row, bytes): batch_entry's answer for a contiguous tensor, kept across buffers (one per
# recorder: `probes host` makes one per step; a model has few distinct shapes). A refinement of
# batch_entry's own key, which depends on these and pointer % 16 == 0 (tests/test_probe_host.py)
_ENTRIES: dict = {}
# (shape, dtype, dim, full, data pointer % 16, is_cuda) -> (launch key, row tail with O_B unset,
# bytes, elements after dim): add_span's rows, whose offset changes record by record
_SPANS: dict = {}


def batch_size() -> int:
    """Records per launch: TPDIAG_HASH_BATCH (default 64; 1 = a launch per record)."""
    return rh.knob_int("TPDIAG_HASH_BATCH", 64, 4096)


def cap_bytes(device=None) -> int:
    """Bytes of queued tensors that start a launch: TPDIAG_HASH_CAP_MB, else CAP_BYTES or 1% of
    the CUDA device's memory, whichever is less."""
    mib = rh.knob_int("TPDIAG_HASH_CAP_MB", 0, 1 << 20)  # 0: not set
    if mib:
        return mib << 20
    if device is not None and device.type == "cuda":
        return min(CAP_BYTES, torch.cuda.get_device_properties(device).total_memory // CAP_FRACTION)
    return CAP_BYTES


class HashBuffer:
    """Rows for every hashed record of a run, on one device, zeroed in chunks; one host
    transfer for the whole run."""

    CHUNK = 4096

    def __init__(self, device, batch: int | None = None):
        self.device = device
        self.batch = batch_size() if batch is None else batch
        self.cap = cap_bytes(torch.device(device))
        self.ints: list[torch.Tensor] = []
        self.floats: list[torch.Tensor] = []
        self.n = 0
        self.queue: dict = {}  # (chunk, key) -> [(words, version, owner, version, table row)]
        self.queued = 0
        self.queued_bytes = 0
        self.stale: list[int] = []  # slots
        self._ring = None  # launch tables (see _table)
        self._ring_stream = None  # the raw stream the last table was copied on
        self._slot = 0
        self._takes: dict = {}  # (dtype, is_cuda) -> rh.triton_ok (add_whole)
        self.deferred: list = []  # small records off the Triton path, hashed at take()
        self.deferred_bytes = 0

    def add(self, t: torch.Tensor, dim: int | None = None, full: int | None = None,
            offset: int = 0, owner: torch.Tensor | None = None) -> int:
        """Hash a shard into a fresh row (now, or queued); returns the row's slot. owner: the
        tensor t is the local shard of (a DTensor), whose version counter is watched too - an
        in-place op on a DTensor bumps its counter, not its local tensor's. t may require grad
        (queued as it is, as the owner always was; detached where torch ops read it)."""
        n = self.n
        i, r = divmod(n, self.CHUNK)
        if i == len(self.ints):
            self.ints.append(torch.zeros((self.CHUNK, 4), dtype=torch.int64, device=self.device))
            self.floats.append(torch.zeros((self.CHUNK, 2), dtype=torch.float64, device=self.device))
        self.n = n + 1
        t = rh.plain(t)
        if self.batch > 1 and rh.triton_ok(t):
            if t.is_contiguous():
                # A step has few distinct (shape, dtype, split, alignment): batch_entry runs once
                # for each, its row reused with this record's pointer and row (host time per
                # record). t itself is queued: the kernel reads its words through the pointer,
                # and t's counter is the one its word view would have shared.
                ptr = t.data_ptr()
                ek = (t.shape, t.dtype, dim, full, offset, ptr % 16)
                hit = _ENTRIES.get(ek)
                if hit is None:
                    if len(_ENTRIES) > 4096:
                        _ENTRIES.clear()
                    key, words, row = rb.batch_entry(t, dim, full, offset, r)
                    hit = _ENTRIES[ek] = (key, tuple(row[2:]), words.numel() * words.element_size())
                key, tail, nbytes = hit
                row = (ptr, r) + tail
                words = t
            else:  # copied (words): the copy cannot change; detached, no autograd node made
                key, words, row = rb.batch_entry(t.detach(), dim, full, offset, r)
                owner, nbytes = words, words.numel() * words.element_size()
            version = words._version
            if owner is None or owner is words:
                self._enqueue(i, key, (words, version, words, version, row), nbytes)
            else:
                self._enqueue(i, key, (words, version, owner, owner._version, row), nbytes)
        else:
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            if self.batch > 1 and nbytes <= DEFER_BYTES and self.deferred_bytes + nbytes <= DEFER_CAP:
                # a small record the Triton kernel does not take (int64 token ids): copied now
                # (one op), hashed by the torch path when rows are read - its many small ops
                # leave the step, the copy cannot change
                self.deferred.append((t.clone(), dim, full, offset, i, r))
                self.deferred_bytes += nbytes
            else:
                # (chunk, chunk, row): the kernel offsets into the chunk itself
                rh.shard_lanes(t, dim, full, offset, out=(self.ints[i], self.floats[i], r))
        return n

    def take_lanes(self, slots: list):
        """hashbuf.take, where a slot may be a tuple of rows (a _StridedShard's pieces, each hashed
        at its own offset): the pieces' lanes, counts and sums add up, their absmax is the max
        (compared as float64 bit patterns: order-preserving for values >= 0)."""
        if not any(isinstance(s, tuple) for s in slots):
            return self.take(slots)
        flat = [x for s in slots for x in (s if isinstance(s, tuple) else (s,))]
        ints, floats = self.take(flat)
        out_i, out_f, at = [], [], 0
        for s in slots:
            k = len(s) if isinstance(s, tuple) else 1
            i, f = ints[at:at + k], floats[at:at + k]
            at += k
            lanes = i[:, :3].sum(0)
            lanes[:2] &= 0xFFFFFFFF
            if bool((i[:, 2] < 0).any()):  # a stale piece (STALE) makes the whole record stale
                lanes[2] = i[:, 2].min()
            out_i.append(torch.cat([lanes, i[:, 3].amax(0, keepdim=True)]))
            out_f.append(f.sum(0))
        return torch.stack(out_i), torch.stack(out_f)

    def add_whole(self, t: torch.Tensor, shape, dtype, version: int) -> int:
        """add(t) of a whole plain tensor or Parameter (Recorder.add's fast path, most records):
        the queued case inline, without add's general checks - a step's host time is per record,
        and a busy host pays ~3x this machine's (`probes host --cuda`). A Parameter is queued as
        itself: the kernel reads its words by pointer, its counter is the one a detached view
        shares. Anything else goes through add. shape, dtype, version: t's, as the caller has read
        them already (each read is a C-API call, and a step's host time is in such calls)."""
        n = self.n
        r = n % self.CHUNK
        hit = None
        if r and self.batch > 1 and t.is_contiguous() and t.numel():
            ok = self._takes.get((dtype, t.is_cuda))
            if ok is None:  # rh.triton_ok by dtype and device, once per buffer
                ok = self._takes[(dtype, t.is_cuda)] = rh.triton_ok(torch.empty(rh.TRITON_MIN_NUMEL, dtype=dtype, device=t.device))
            if ok:
                ptr = t.data_ptr()
                hit = _ENTRIES.get((shape, dtype, None, None, 0, ptr % 16))
        if hit is None:  # a new chunk or shape, or not the Triton path: the general add
            return self.add(t if type(t) is torch.Tensor else t.detach())
        self.n = n + 1
        key, tail, nbytes = hit
        self._enqueue(n // self.CHUNK, key, (t, version, t, version, (ptr, r) + tail), nbytes)
        return n

    def add_span(self, t: torch.Tensor, dim: int, full: int, offset: int, version: int) -> int:
        """add(t, dim, full, offset) of a plain tensor at a new offset of the same geometry (a
        decode call's record: the same shape as the call before, one position further on,
        probes/spans.py). A launch row depends on the offset in one column only (O_B =
        offset x the elements after dim), so the row is cached without it and the offset put
        in: batch_entry's dict, keyed by the offset, would miss on every call. Anything not the
        queued contiguous case goes through add. version: t's counter, read by the caller."""
        n = self.n
        r = n % self.CHUNK
        hit = None
        if r and self.batch > 1 and t.is_contiguous():
            ptr = t.data_ptr()
            # the device kind in the key: a CPU tensor of a cached CUDA geometry is add's (torch)
            ek = (t.shape, t.dtype, dim, full, ptr % 16, t.is_cuda)
            hit = _SPANS.get(ek)
            if hit is None and rh.triton_ok(t):
                if len(_SPANS) > 4096:
                    _SPANS.clear()
                key, words, row = rb.batch_entry(t, dim, full, 0, r)
                b = rh.slab(t.shape, dim, full, 0)[2]  # O_B = offset x this (batch_entry's slab)
                hit = _SPANS[ek] = (key, tuple(row[2:]), words.numel() * words.element_size(), b)
        if hit is None:
            return self.add(t, dim, full, offset)
        self.n = n + 1
        key, (a, slab, fb, _, n_col, total), nbytes, b = hit
        self._enqueue(n // self.CHUNK, key, (t, version, t, version, (ptr, r, a, slab, fb, offset * b, n_col, total)),
                      nbytes)
        return n

    def _enqueue(self, chunk: int, key, item: tuple, nbytes: int) -> None:
        """Queue one record (words, version, owner, owner's version, table row) for the launch of
        its (chunk, key); launch at BATCH records or cap_bytes() queued."""
        q = self.queue.get((chunk, key))
        if q is None:
            self.queue[(chunk, key)] = [item]
        else:
            q.append(item)
        self.queued += 1
        self.queued_bytes += nbytes
        if self.queued >= self.batch or self.queued_bytes >= self.cap:
            self.flush()

    def flush(self) -> None:
        """Hash every queued record: one launch per (chunk, launch key)."""
        if not self.queued:
            return
        queue, self.queue, self.queued, self.queued_bytes = self.queue, {}, 0, 0
        for (i, key), items in queue.items():
            rows = []
            for words, version, owner, owner_version, row in items:
                if words._version != version or owner._version != owner_version:
                    self.ints[i][row[1], 2] = STALE
                    self.stale.append(i * self.CHUNK + row[1])
                else:
                    rows.append(row)
            if rows:
                nprog = rb.batch_nprog(max(row[7] for row in rows), self.device, key[0], len(rows))
                rb.batch_launch(key, self._table(rows), len(rows), nprog, self.ints[i], self.floats[i])

    def _table(self, rows: list) -> torch.Tensor:
        """The launch's table on the device. On CUDA through a ring of pinned host rows and
        device rows, copied without blocking: a pageable copy would wait for the stream (the
        host stalled behind the GPU, what queueing is for), a fresh pinned tensor per launch
        costs an allocation. The host time per launch is what a small step pays ~50 times
        (`probes overhead`, 1 x 2048): the rows go in packed by struct (Python ints to int64
        without numpy's per-item conversion), and one event per RING_GROUP slots says when a
        group's copies are done - a slot's earlier copy is older than its group's event, which
        is waited for before the group's first slot is written again."""
        n = len(rows) * rb.TABLE_COLS
        if self.device.type != "cuda":
            return torch.tensor([v for row in rows for v in row], dtype=torch.int64)
        if self._ring is None:
            width = max(self.batch, 1) * rb.TABLE_COLS
            host = torch.zeros((RING, width), dtype=torch.int64).pin_memory()
            dev = torch.zeros((RING, width), dtype=torch.int64, device=self.device)
            # one view per slot, made once: a slot's whole row is copied (a few KiB) and handed
            # to the launch, which reads its first len(rows) rows - no indexing per launch
            self._ring = (list(host.unbind(0)), [memoryview(r) for r in host.numpy()], list(dev.unbind(0)),
                          [None] * (RING // RING_GROUP), dev.device.index)
        host, views, dev, events, index = self._ring
        raw = torch._C._cuda_getCurrentRawStream(index)
        if raw != self._ring_stream:
            # a group's event covers its copies only on one stream: at a switch (rare: a model
            # running on a stream of its own), every earlier copy is waited for once
            if self._ring_stream is not None:
                torch.cuda.synchronize(index)
                events[:] = [None] * len(events)
            self._ring_stream = raw
        slot, self._slot = self._slot, (self._slot + 1) % RING
        group, pos = divmod(slot, RING_GROUP)
        if pos == 0 and events[group] is not None:
            events[group].synchronize()  # long done by the time the ring comes round
        struct.pack_into(f"{n}q", views[slot], 0, *[v for row in rows for v in row])
        dev[slot].copy_(host[slot], non_blocking=True)
        if pos == RING_GROUP - 1:
            ev = events[group] = events[group] or torch.cuda.Event()
            ev.record()
        return dev[slot]

    def take(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.flush()
        for t, dim, full, offset, i, r in self.deferred:
            rh.shard_lanes(t, dim, full, offset, out=(self.ints[i], self.floats[i], r))
        self.deferred, self.deferred_bytes = [], 0
        if not self.ints:
            return (torch.zeros((0, 4), dtype=torch.int64, device=self.device),
                    torch.zeros((0, 2), dtype=torch.float64, device=self.device))
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        ints = torch.cat(self.ints)[idx]
        # Each program adds its 32-bit partial lanes into the row as an int64 sum, not reduced:
        # the row's high bits depend on how the launch split the tensor (programs per SM, the
        # records sharing the launch), only the low 32 bits are the lanes. Reduced here, so no
        # reader can compare the same tensor's rows from two launches and see a difference (the
        # self-check did: bf16 compares with large records failed it at the logits on CUDA
        # after the launch fill, b54b0dd).
        ints[:, :2] &= rh.M32
        return ints, torch.cat(self.floats)[idx]
