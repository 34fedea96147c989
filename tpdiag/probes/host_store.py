"""Host memory for full capture's records: a list of equal chunks (a record larger than a chunk
spans several), spilled to disk past a host-memory budget.

Past the budget the oldest full chunks are written to the spill directory by a background thread
once their copies completed, and their memory is reused; a reader gets the bytes from memory or
file. The same tensor recorded again unchanged (same object, same version counters) is copied
once. What is put here, and when, is probes/stream.py's (full capture's records).
"""
from __future__ import annotations

import collections
import os
import threading
import weakref

import torch

from tpdiag.kernels import alloc
from tpdiag.probes.host_budget import default_budget, parse_bytes

BUDGET_ENV = "TPDIAG_HOST_BUDGET"   # bytes of host memory for captured records (K/M/G suffixes)
CHUNK_ENV = "TPDIAG_HOST_CHUNK"     # bytes per host chunk
PINNED_ENV = "TPDIAG_HOST_PINNED"  # 0: full capture's host chunks not pinned (A/B, CUDA only)
DEFAULT_CHUNK = 128 << 20
ALIGN = 64                          # record offsets in a chunk: every dtype's view stays aligned


# Pinned chunks outlive a HostStore, process-wide: pinning host memory is slow (the kernel
# zeroes and locks every page; ~1.5 GB/s seen on an H200 host), so a process that captures again
# reuses what it pinned. release_pool() gives it back.
_POOL: dict = {}  # (chunk bytes, pinned) -> [uint8 tensors]


def check_env() -> None:
    """Full capture's settings from the environment, parsed up front (a compare reads them before
    any world starts): a bad one is BadInput, one line, not a failure inside every rank."""
    for name in (BUDGET_ENV, CHUNK_ENV):
        if os.environ.get(name):
            parse_bytes(os.environ[name], name)
    if os.environ.get(PINNED_ENV, "1") not in ("0", "1"):
        from tpdiag.errors import BadInput

        raise BadInput(f"{PINNED_ENV}={os.environ[PINNED_ENV]!r}: expected 0 or 1")


def release_pool() -> None:
    _POOL.clear()


class _Chunk:
    __slots__ = ("id", "buf", "used", "stream", "event", "path", "queued")

    def __init__(self, cid: int, buf: torch.Tensor, stream):
        self.id, self.buf, self.used, self.stream = cid, buf, 0, stream
        self.event = self.path = None
        self.queued = False


class Captured:
    """A record's tensor held on the host by a HostStore: in memory or spilled to disk."""
    __slots__ = ("store", "segs", "dtype", "shape", "nbytes", "lanes", "__weakref__")

    def __init__(self, store, segs, dtype, shape, nbytes, lanes=None):
        self.store, self.segs, self.dtype, self.shape = store, segs, dtype, torch.Size(shape)
        self.nbytes, self.lanes = nbytes, lanes

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def get(self) -> torch.Tensor:
        """A fresh host tensor with the recorded bits."""
        return self.store.read(self)

    def write_to(self, f) -> None:
        """The raw bytes to an open binary file, chunk by chunk (nothing materialised whole)."""
        self.store.write_to(self, f)


class HostStore:
    def __init__(self, device: torch.device, *, budget: int | None = None,
                 spill_dir: str | None = None, chunk: int | None = None):
        self.device = torch.device(device)
        # TPDIAG_HOST_PINNED=0: pageable chunks and synchronous copies (A/B). A world is a fresh
        # process, so every chunk it captures into is pinned anew (~1.5 GB/s on an H200 host):
        # several seconds for the GBs a second pass's reference captures once - not yet weighed
        # against the pageable copies' own cost on a GPU
        self.pinned = self.device.type == "cuda" and os.environ.get(PINNED_ENV, "1") != "0"
        env_chunk, env_budget = os.environ.get(CHUNK_ENV), os.environ.get(BUDGET_ENV)
        self.chunk_bytes = chunk or (parse_bytes(env_chunk, CHUNK_ENV) if env_chunk else DEFAULT_CHUNK)
        self.chunk_bytes = max(ALIGN, self.chunk_bytes - self.chunk_bytes % ALIGN)
        self.budget = budget or (parse_bytes(env_budget, BUDGET_ENV) if env_budget else default_budget())
        self.spill_dir = spill_dir
        self.chunks: list[_Chunk] = []
        self.cur: _Chunk | None = None
        self.free: list[torch.Tensor] = []
        self.allocated = 0          # bytes of chunk buffers held (in use or free for reuse)
        self.live = 0               # bytes of chunk buffers holding data not queued for spilling
        self.pending = 0            # chunks queued for the writer, not yet on disk
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.thread = None
        self.error: BaseException | None = None
        self.seen: dict = {}        # id(tensor) -> (weakref, versions, Captured): copied once
        self.stats = {"records": 0, "captured_bytes": 0, "copied_bytes": 0, "spilled_bytes": 0,
                      "host_peak_bytes": 0, "chunks": 0}

    # -- write side -------------------------------------------------------------------------
    def put(self, local: torch.Tensor, owner=None, *, lanes: bool = False) -> Captured:
        """Queue the copy of `local` (detached; a device or host tensor). `owner`: the tensor the
        user recorded (a DTensor's wrapper), whose identity and version counters say whether
        this is the same tensor as an earlier record, unchanged. lanes: also its record hash
        lanes, computed now on its device, read once at finish()."""
        self._check_error()
        owner = local if owner is None else owner
        version = (owner._version, local._version)
        seen = self.seen.get(id(owner))
        if seen is not None and seen[0]() is owner and seen[1] == version and seen[2].dtype == local.dtype \
                and seen[2].shape == local.shape and (seen[2].lanes is not None or not lanes):
            self.stats["records"] += 1
            self.stats["captured_bytes"] += seen[2].nbytes
            return seen[2]
        from tpdiag.kernels.record_hash import plain

        src = plain(local)
        if not src.is_contiguous():
            src = src.contiguous()  # a transient device copy; the record's bytes in logical order
        n = src.numel() * src.element_size()
        ln = None
        if lanes:
            from tpdiag.kernels.record_hash import shard_lanes

            ln = shard_lanes(src, stats=False)[0]  # a hash: no statistics needed
        segs = self._copy_in([src.reshape(-1).view(torch.uint8)] if n else [])
        cap = Captured(self, segs, src.dtype, src.shape, n, ln)
        self.seen[id(owner)] = (weakref.ref(owner), version, cap)
        self.stats["records"] += 1
        self.stats["captured_bytes"] += n
        self.stats["copied_bytes"] += n
        return cap

    def put_bytes(self, parts: list, dtype, shape) -> Captured:
        """One record made of these uint8 pieces, in order (a gathered stack: each rank's shard,
        each maybe in several windows' pieces), copied into the chunks once - no whole tensor
        assembled first (the gather's stack and clones were two more copies of every byte)."""
        self._check_error()
        parts = [p for p in parts if p.numel()]
        n = sum(p.numel() for p in parts)
        if n != torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size():
            raise ValueError(f"put_bytes: {n} bytes do not make a {dtype} tensor of shape {tuple(shape)}")
        cap = Captured(self, self._copy_in(parts), dtype, shape, n)
        self.stats["records"] += 1
        self.stats["captured_bytes"] += n
        self.stats["copied_bytes"] += n
        return cap

    def _copy_in(self, flats: list) -> list:
        """Segments (chunk, offset, bytes) holding these flat uint8 tensors' bytes one after another."""
        segs = []
        stream = torch.cuda.current_stream(self.device) if self.pinned and flats else None
        for flat in flats:
            n, at = flat.numel(), 0
            while at < n:
                c = self._room(stream)
                off = c.used
                k = min(n - at, self.chunk_bytes - off)
                c.buf[off:off + k].copy_(flat[at:at + k], non_blocking=self.pinned)
                c.used = -(-(off + k) // ALIGN) * ALIGN
                segs.append((c, off, k))
                at += k
        return segs

    def _room(self, stream) -> _Chunk:
        c = self.cur
        if c is not None and c.used < self.chunk_bytes and c.stream == stream:
            return c
        if c is not None:
            self._seal(c)
        with self.cond:
            buf = self._buffer()
            c = self.cur = _Chunk(len(self.chunks), buf, stream)
            self.chunks.append(c)
            self.live += self.chunk_bytes
            self.stats["chunks"] += 1
        return c

    def _buffer(self) -> torch.Tensor:
        # under self.cond
        while not self.free and self.allocated + self.chunk_bytes > self.budget:
            self._check_error()
            if not self.pending and not self._queue_oldest():
                break  # nothing left to spill (budget below one chunk): over it, not stuck
            if self.pending:
                self.cond.wait()
        if self.free:
            return self.free.pop()
        self.allocated += self.chunk_bytes
        self.stats["host_peak_bytes"] = max(self.stats["host_peak_bytes"], self.allocated)
        pool = _POOL.get((self.chunk_bytes, self.pinned))
        if pool:
            return pool.pop()
        # every byte read back is a record's, copied in first (alignment gaps are only ever
        # spilled with the chunk, never read): no deterministic-mode fill of the whole chunk
        return alloc.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned)

    def _seal(self, c: _Chunk) -> None:
        if self.pinned and c.event is None:
            c.event = torch.cuda.Event()
            c.event.record(c.stream)
        if c is self.cur:
            self.cur = None
        with self.cond:
            # spill ahead: the writer works while the device keeps producing
            while self.live + self.chunk_bytes > self.budget and self._queue_oldest():
                pass

    def _queue_oldest(self) -> bool:
        # under self.cond
        for c in self.chunks:
            if c.buf is not None and not c.queued and c is not self.cur:
                c.queued = True
                self.live -= self.chunk_bytes
                self.pending += 1
                self.queue.append(c)
                if self.thread is None:
                    if self.spill_dir is None:  # no directory given: the budget still holds
                        import tempfile

                        self.spill_dir = tempfile.mkdtemp(prefix="tpdiag-spill-")
                    os.makedirs(self.spill_dir, exist_ok=True)
                    self.thread = threading.Thread(target=self._writer, name="tpdiag-spill", daemon=True)
                    self.thread.start()
                self.cond.notify_all()
                return True
        return False

    def _writer(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                c = self.queue.popleft()
            if c is None:
                return
            try:
                # one writer: on an H200 host spilling moved ~3.4 GB/s with 1, 4 or 8 writers alike
                # (the disk's pace, not the thread's; `git show d055ef2:docs/benchmarks.md`,
                # "Session 13")
                if c.event is not None:
                    c.event.synchronize()
                path = os.path.join(self.spill_dir, f"chunk{c.id:06d}.bin")
                with open(path, "wb") as f:
                    f.write(memoryview(c.buf[:c.used].numpy()))
                with self.cond:
                    c.path = path
                    self.free.append(c.buf)
                    c.buf = None
                    self.stats["spilled_bytes"] += c.used
            except BaseException as e:  # noqa: BLE001 - surfaced on the recording thread
                with self.cond:
                    c.queued = False  # stays in memory: nothing lost
                    self.live += self.chunk_bytes
                    self.error = self.error or e
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def _check_error(self) -> None:
        if self.error is not None:
            from tpdiag.base.files import WriteError

            e = self.error
            raise WriteError(f"{self.spill_dir}: cannot spill captured records to disk "
                             f"({getattr(e, 'strerror', None) or e}); set {BUDGET_ENV} higher or "
                             "free disk space")

    # -- read side --------------------------------------------------------------------------
    def finish(self) -> None:
        """Every copy issued so far is complete (or completes before any read)."""
        if self.cur is not None:
            c = self.cur
            self._seal(c)

    def drain(self) -> None:
        """Wait until every chunk queued for spilling is on disk (or failed)."""
        with self.cond:
            while self.pending:
                self.cond.wait()
        self._check_error()

    def _bytes(self, c: _Chunk, off: int, k: int, out: torch.Tensor | None, copy: bool = True):
        """Chunk bytes [off, off + k) copied into out (or returned as a fresh tensor). copy=False
        (out None): a view of the chunk where it is in memory, for a caller that is done with it
        before this store takes another record - write_to, on the recording thread, the only one
        that puts: the spill writer may drop the chunk meanwhile, never refill it (a record
        file's bytes written straight from the chunks: at a region pass's GBs a world, one
        memory copy of each less)."""
        if c.event is None and self.pinned and c is self.cur:
            self._seal(c)
        if c.event is not None:
            c.event.synchronize()
        with self.cond:
            if c.buf is not None:
                if out is None:
                    return c.buf[off:off + k] if not copy else c.buf[off:off + k].clone()
                out.copy_(c.buf[off:off + k])
                return out
            path = c.path
        if out is None:
            out = torch.empty(k, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(off)
            f.readinto(memoryview(out.numpy()))
        return out

    def read(self, cap: Captured) -> torch.Tensor:
        self._check_error()
        out = alloc.empty(cap.nbytes, dtype=torch.uint8)  # the segments below write every byte
        at = 0
        for c, off, k in cap.segs:
            self._bytes(c, off, k, out[at:at + k])
            at += k
        return out.view(cap.dtype).reshape(cap.shape)

    def read_into(self, cap: Captured, a: int, b: int, out: torch.Tensor) -> None:
        """Bytes [a, b) of a record into `out` (uint8, b - a bytes, host or device): straight from
        the chunks (or spill files), with no whole copy of the record made first."""
        self._check_error()
        at = 0  # where the current segment starts in the record
        for c, off, k in cap.segs:
            lo, hi = max(a, at), min(b, at + k)
            if lo < hi:
                dst = out[lo - a:hi - a]
                if dst.device.type == "cpu":
                    self._bytes(c, off + lo - at, hi - lo, dst)
                else:  # a spilled chunk is read into host memory first
                    dst.copy_(self._bytes(c, off + lo - at, hi - lo, None, copy=False))
            at += k
            if at >= b:
                break

    def write_to(self, cap: Captured, f) -> None:
        for c, off, k in cap.segs:
            f.write(memoryview(self._bytes(c, off, k, None, copy=False).numpy()))

    def close(self) -> None:
        """Stop the writer, drop the spill files and host chunks (the records become unreadable)."""
        # seal first: sealing past the budget queues a spill (and may start the writer), which
        # must finish before the files are removed - sealed after the writer stopped, it started
        # a new writer that re-created the spill directory behind close()
        if self.cur is not None:
            self._seal(self.cur)
        if self.thread is not None:
            with self.cond:
                self.queue.append(None)
                self.cond.notify_all()
            self.thread.join()
            self.thread = None
        keep = [c.buf for c in self.chunks if c.buf is not None] + self.free
        if self.pinned:
            # a pooled chunk is written again only after the copies into it are done
            for c in self.chunks:
                if c.buf is not None and c.event is not None:
                    c.event.synchronize()
            _POOL.setdefault((self.chunk_bytes, True), []).extend(keep)
        for c in self.chunks:
            if c.path:
                try:
                    os.unlink(c.path)
                except OSError:
                    pass
            c.buf = None
        self.chunks, self.free, self.cur, self.seen = [], [], None, {}
        if self.spill_dir and os.path.isdir(self.spill_dir):
            try:
                os.rmdir(self.spill_dir)
            except OSError:
                pass
