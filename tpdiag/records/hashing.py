"""Order-aware 64-bit hashes of tensors' raw bits, computed where the tensor lives.

One definition everywhere (kernels/record_hash.py): two 32-bit lanes summed over elements mixed
with their positions. The mix is versioned (HASH_VERSION): every record set's world.json and every
run's manifest.json say which mix made its hashes, and hashes of two versions are never compared. Because the lanes are sums, a shard's lanes computed with its global
positions add up to the whole tensor's - hash-first capture compares TP=N with TP=1 without
ever gathering a tensor. The hash also covers dtype and (whole) shape.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib

import torch

from tpdiag.kernels.record_hash_ref import HASH_VERSION, MIXES

M32 = 0xFFFFFFFF
# A record set written before the mix was versioned (no "hash_version" in its world.json or
# manifest.json) was hashed with the first mix.
UNVERSIONED = 1


def hash_version(meta) -> int:
    """The lane-mix version a run directory's world.json / manifest.json records (UNVERSIONED
    when absent: written before the field existed)."""
    v = meta.get("hash_version", UNVERSIONED) if isinstance(meta, dict) else UNVERSIONED
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def check_same_hash_version(va: int, vb: int, name_a: str, name_b: str) -> None:
    """Hashes made with two lane mixes differ for equal tensors: refuse to compare them (BadInput)
    rather than report every hashed record as a difference."""
    if va != vb:
        from tpdiag.errors import BadInput

        def say(v):
            return f"version {v}" if v in MIXES else f"unknown version {v!r}"

        raise BadInput(f"record hashes not comparable: {name_a} was hashed with lane mix {say(va)}, "
                       f"{name_b} with {say(vb)}; recapture the older one with this tpdiag "
                       f"(hash version {HASH_VERSION})")


@functools.lru_cache(maxsize=4096)
def _head(dtype: str, shape) -> int:
    # hashlib, not hash(): Python's str hash changes from process to process
    return int.from_bytes(hashlib.sha256(f"{dtype}{tuple(shape)}".encode()).digest()[:8], "little")


def hash_of_lanes(lane_a: int, lane_b: int, dtype: str, shape) -> str:
    """16 hex digits from a whole tensor's lanes, its dtype ('float32') and its shape."""
    v = (lane_a & M32) | ((lane_b & M32) << 32)
    return format(v ^ _head(dtype.replace("torch.", ""), tuple(shape)), "016x")


def lanes_of(h: str, dtype: str, shape) -> int:
    """The two lanes a hash holds (hash_of_lanes without its dtype and shape): the lanes are sums
    over the raw words by flat position, so two tensors of one dtype whose flat bytes are equal
    have equal lanes whatever their shapes (a [2, n/2, m] stack of row shards and its [n, m] whole)."""
    return int(h, 16) ^ _head(dtype.replace("torch.", ""), tuple(shape))


# Where a host tensor of at least _DEVICE_MIN bytes is hashed (checks_on): None, on the host. A
# compare's parent re-hashes every record it reads (GBs at 1B-8B: 15 s of its 30 s second-pass diff
# on a 32-core host); on a GPU host the same lanes come from the device kernel in < 1 s. The lanes
# are exact integer sums by flat position, so pieces hashed at their offsets add up to the host's.
_DEVICE: list = [None]
_DEVICE_MIN = 4 << 20
_PIECE = 256 << 20  # bytes copied to the device at a time: a bounded buffer, whatever the record


@contextlib.contextmanager
def checks_on(device):
    """Hash big host tensors on `device` (a CUDA device; None: on the host) inside the block
    (device_lanes gives the GPU's memory back after each record)."""
    before = _DEVICE[0]
    _DEVICE[0] = torch.device(device) if device is not None else None
    try:
        yield
    finally:
        _DEVICE[0] = before


def check_device():
    """The device checks_on set for this block (None: the host). The diff's float64 bounds and
    judgements run there too (diff/on_device.py): one decision where the parent may use a GPU."""
    return _DEVICE[0]


def device_lanes(t: torch.Tensor, device, version: int = HASH_VERSION, piece: int = _PIECE) -> tuple[int, int]:
    """(lane_a, lane_b) mod 2**32 of host tensor t, hashed on `device` a piece at a time, each
    piece placed at its flat offset: whole_lanes(t)'s lanes."""
    from tpdiag.kernels.record_hash import shard_lanes

    flat = t.detach().contiguous().reshape(-1)
    n = flat.numel()
    step = max(1, piece // max(1, flat.element_size()))
    la = lb = 0
    for s in range(0, n, step):
        part = flat[s:s + step].to(device)
        ints, _ = shard_lanes(part, 0, n, s, mix=version, stats=False)
        a, b = (int(v) for v in ints[:2].tolist())
        la += a
        lb += b
    del part
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the worlds that run after this diff get GPU 0's memory back
    return la & M32, lb & M32


def warm(device):
    """Start `device`'s CUDA context and compile the hash kernel for the dtypes records mostly
    have, in a background thread (returned, started; None where there is nothing to warm): their
    first use costs ~3.5 s on an H200 host, which the second pass's worlds can hide. The lanes of
    the warm-up tensors are thrown away - nothing is judged by them."""
    if device is None or torch.device(device).type != "cuda":
        return None
    import threading

    def run():
        try:
            for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.int64):
                device_lanes(torch.zeros(_DEVICE_MIN // 2, dtype=dtype), device)
        except Exception:  # noqa: BLE001 - a warm-up only: the real use reports its own errors
            pass

    th = threading.Thread(target=run, name="tpdiag-warm-hash", daemon=True)
    th.start()
    return th


def tensor_hash(t: torch.Tensor, version: int = HASH_VERSION) -> str:
    """The hash of a whole tensor (one host sync); `version`: the lane mix (an old run
    directory's, to check its stored tensors)."""
    t = t.detach()
    if type(t) is torch.Tensor and t.device.type == "cpu":
        from tpdiag.kernels.record_hash_ref import whole_lanes

        dev = _DEVICE[0]
        lanes = None
        if dev is not None and t.numel() * t.element_size() >= _DEVICE_MIN:
            try:
                lanes = device_lanes(t, dev, version)
            except RuntimeError:  # no room on the GPU, a driver error: the host's lanes are the same
                _DEVICE[0] = None  # for the rest of the block
        a, b = lanes if lanes is not None else whole_lanes(t, version)  # no tensors made per record
    else:
        from tpdiag.kernels.record_hash import shard_lanes

        # the lanes alone: a stored tensor's hash (checked on every read) needs no statistics
        ints, _ = shard_lanes(t, mix=version, stats=False)
        a, b = (int(v) for v in ints[:2].tolist())
    return hash_of_lanes(a, b, str(t.dtype), t.shape)


def compose(parts: list[tuple[list[int], list[float]]], how: str) -> tuple[list[int], list[float]]:
    """Whole-tensor lanes/statistics from per-rank shares: 'sum' for a sharded tensor (the
    shares add up), 'first' for a replica (every rank holds the whole tensor)."""
    if how == "first" or len(parts) == 1:
        return list(parts[0][0]), list(parts[0][1])
    ints = [sum(p[0][i] for p in parts) for i in range(3)]
    ints[0] &= M32
    ints[1] &= M32
    floats = [sum(p[1][0] for p in parts), sum(p[1][1] for p in parts), max(p[1][2] for p in parts)]
    return ints, floats
