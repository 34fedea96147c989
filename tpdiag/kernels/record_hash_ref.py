"""The record hash in plain torch integer ops: every dtype and device (the CPU path), the same
lanes bit for bit as the Triton kernels of kernels/record_hash.py (whose docstring defines
them), and a plain-Python definition for tests."""
from __future__ import annotations

import torch

C1, C2, C3 = 0x9E3779B1, 0x85EBCA77, 0x85EBCA6B
M32 = 0xFFFFFFFF
# The lane mix's version (record_hash.py's docstring): run directories record it
# (records/hashing.py). 1: the first mix, kept for reading old run directories and for the
# benchmarks' side-by-side timing; 2: the shipped one.
HASH_VERSION = 2
MIXES = (1, 2)
R1, R2 = 7, 19  # version 2's rotations (chosen by benchmarks/jobs/hash_collisions.py's classes)


def mix_torch(y: torch.Tensor, mix: int = HASH_VERSION) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the factor of x in lane_b's term) of y = w * C1 + k * C2 (int64 in [0, 2**32))."""
    if mix == 2:
        # both rotations from one 64-bit word holding y twice: rotl(y, r) = bits 32-r .. 63-r
        d = y | (y << 32)
        return (y ^ (d >> (32 - R1)) ^ (d >> (32 - R2))) & M32, y
    if mix != 1:
        raise ValueError(f"unknown record-hash mix {mix!r} (known: {MIXES})")
    x = y ^ (y >> 16)
    x = (x * C3) & M32
    x = x ^ (x >> 15)
    return x, x


def mix_int(y: int, mix: int = HASH_VERSION) -> tuple[int, int]:
    """mix_torch for one Python int (the plain-Python definition)."""
    if mix == 2:
        rot = lambda r: ((y << r) | (y >> (32 - r))) & M32  # noqa: E731
        return y ^ rot(R1) ^ rot(R2), y
    if mix != 1:
        raise ValueError(f"unknown record-hash mix {mix!r} (known: {MIXES})")
    x = y ^ (y >> 16)
    x = (x * C3) & M32
    x ^= x >> 15
    return x, x


def _raw(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's raw bits as a flat integer view (no copy) and the mask that makes a word of
    it non-negative: _words at once, lanes_fast a chunk at a time."""
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    if t.dtype == torch.bool or size == 1:
        return t.view(torch.uint8), 0xFF
    if size == 2:
        return t.view(torch.int16), 0xFFFF
    if size in (4, 8, 16):  # 16: complex128 (the float64 re-execution of a complex64 RoPE table)
        return t.view(torch.int32), M32
    raise TypeError(f"cannot hash dtype {t.dtype}")


def _per(t: torch.Tensor) -> int:
    """32-bit words per element."""
    return max(1, t.element_size() // 4) if t.dtype != torch.bool else 1


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's raw bits as int64 words in [0, 2**32), flat; and words per element."""
    v, mask = _raw(t)
    return v.to(torch.int64) & mask, _per(t)


def _stats_torch(t: torch.Tensor):
    if t.dtype == torch.bool:
        v = t.to(torch.float64)
    elif t.is_complex():
        v = torch.view_as_real(t).to(torch.float64)
    else:
        v = t.to(torch.float64)
    fin = torch.isfinite(v)
    vf = torch.where(fin, v, torch.zeros_like(v))
    absmax = vf.abs().max() if vf.numel() else torch.zeros((), dtype=torch.float64, device=t.device)
    return (~fin).sum().to(torch.int64), absmax, torch.stack([vf.sum(), (vf * vf).sum()])


def lanes_torch(t: torch.Tensor, a: int, L: int, b: int, F: int, o: int, out=None, *,
                mix: int = HASH_VERSION):
    """The same row as triton_lanes, with torch integer ops (any dtype, any device); `mix`: the
    hash version (an old run directory's)."""
    w, per = _words(t)
    L_w, b_w, F_w, o_w = (L * per, b, F * per, o * per) if b == 1 else (L, b * per, F, o)
    slab_n = L_w * b_w
    j = torch.arange(w.numel(), device=w.device, dtype=torch.int64)
    k = (j // slab_n) * (F_w * b_w) + o_w * b_w + (j % slab_n) if slab_n else j
    y = (w * C1 + (k & M32) * C2) & M32  # int64 products wrap; their low 32 bits are uint32's
    x, f = mix_torch(y, mix)
    nonfinite, absmax, sums = _stats_torch(t)
    absmax_bits = absmax.reshape(1).view(torch.int64)[0]
    ints = torch.stack([x.sum() & M32, (x * f).sum() & M32, nonfinite, absmax_bits])
    return _put(ints, sums, out)


def _put(ints: torch.Tensor, sums: torch.Tensor, out):
    """(ints, sums), or written into `out`: a HashBuffer slot (ints [n, 4], floats [n, 2], row)
    or a pair of rows."""
    if out is None:
        return ints, sums
    if len(out) == 3:
        out[0][out[2]].copy_(ints)
        out[1][out[2]].copy_(sums)
    else:
        out[0].copy_(ints)
        out[1].copy_(sums)
    return out


# The CPU path's working set: lanes_torch makes ~10 int64 temporaries the size of the whole
# tensor (80+ bytes per element through memory); lanes_fast runs the same arithmetic on chunks of
# this many words in reused buffers, which stay in cache (60x faster on a 2-core x86 host).
CHUNK = 1 << 18


def lanes_fast(t: torch.Tensor, a: int, L: int, b: int, F: int, o: int, out=None, *,
               mix: int = HASH_VERSION, stats: bool = True, chunk: int = CHUNK):
    """lanes_torch's row bit for bit (tests/test_hash_fast.py), chunked: what the CPU runs.
    stats=False: the lanes alone (ints[2:] and floats zero) - a stored tensor's hash needs no
    statistics."""
    if mix not in MIXES:
        raise ValueError(f"unknown record-hash mix {mix!r} (known: {MIXES})")
    v, mask = _raw(t)
    per = _per(t)
    n = v.numel()
    L_w, b_w, F_w, o_w = (L * per, b, F * per, o * per) if b == 1 else (L, b * per, F, o)
    slab_n = L_w * b_w
    one_slab = slab_n >= n  # k = o_w * b_w + j: no division per word
    m0 = max(1, min(chunk, n))
    if v.device.type == "cpu":
        la, lb = _lanes_numpy(v, slab_n, F_w * b_w, o_w * b_w, one_slab, mix, m0)
        nonfinite, absmax, sums = _stats_chunked(t, m0) if stats else (0, 0.0, [0.0, 0.0])
        return _result(la, lb, nonfinite, absmax, sums, t.device, out)
    j = torch.arange(m0, dtype=torch.int64, device=v.device)
    jc2 = (j * C2) & M32 if one_slab else None
    y, d, x = (torch.empty(m0, dtype=torch.int64, device=v.device) for _ in range(3))
    la = lb = 0
    for s in range(0, n, m0):
        m = min(n, s + m0) - s
        yy, dd, xx = y[:m], d[:m], x[:m]
        yy.copy_(v[s:s + m]).bitwise_and_(mask).mul_(C1)
        if one_slab:
            yy.add_(jc2[:m]).add_(((o_w * b_w + s) * C2) & M32)
        else:
            torch.add(j[:m], s, out=dd)
            xx.copy_(dd).floor_divide_(slab_n).mul_(F_w * b_w).add_(o_w * b_w)
            xx.add_(dd.remainder_(slab_n)).bitwise_and_(M32).mul_(C2)
            yy.add_(xx)
        yy.bitwise_and_(M32)
        if mix == 2:
            # mix_torch's version 2 in place: d = y twice in one word, x = y ^ rotl7 ^ rotl19
            torch.bitwise_left_shift(yy, 32, out=dd).bitwise_or_(yy)
            torch.bitwise_right_shift(dd, 32 - R1, out=xx).bitwise_xor_(yy)
            xx.bitwise_xor_(dd.bitwise_right_shift_(32 - R2)).bitwise_and_(M32)
            la += int(xx.sum())
            lb += int(xx.mul_(yy).sum())
        else:
            xm, f = mix_torch(yy, mix)
            la += int(xm.sum())
            lb += int((xm * f).sum())
    nonfinite, absmax, sums = _stats_chunked(t, m0) if stats else (0, 0.0, [0.0, 0.0])
    return _result(la, lb, nonfinite, absmax, sums, t.device, out)


def _result(la: int, lb: int, nonfinite: int, absmax: float, sums, device, out):
    absmax_bits = int(torch.tensor(absmax, dtype=torch.float64).view(torch.int64))
    sums = torch.tensor(sums, dtype=torch.float64, device=device)
    ints = torch.tensor([la & M32, lb & M32, nonfinite, absmax_bits], dtype=torch.int64, device=device)
    return _put(ints, sums, out)


def whole_lanes(t: torch.Tensor, mix: int = HASH_VERSION, chunk: int = CHUNK) -> tuple[int, int]:
    """(lane_a, lane_b) mod 2**32 of a whole CPU tensor: what shard_lanes(t)'s first two ints
    are mod 2**32, without its tensors (a compare's parent checks hundreds of small records)."""
    if mix not in MIXES:
        raise ValueError(f"unknown record-hash mix {mix!r} (known: {MIXES})")
    v, _ = _raw(t)
    n = v.numel()
    chunk = max(1, min(chunk, n))
    pieces = _pieces(n, chunk)
    if len(pieces) == 1:
        la, lb = _lanes_numpy(v, n, n, 0, True, mix, chunk)  # one slab at offset 0
        return la & M32, lb & M32
    # The lanes are sums over words of a function of (word, its index): a piece starting at word
    # s is hashed as a slab at offset s and the pieces' sums added - exact integers, so the same
    # lanes in any order. numpy's ufuncs let go of the GIL: a compare's parent, which checks every
    # record it reads (GBs at 8B), runs the pieces on its idle cores (32 s -> a few on a GPU host).
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(pieces)) as ex:  # joined here: no thread outlives the call (forks)
        parts = list(ex.map(lambda p: _lanes_numpy(v[p[0]:p[1]], n, n, p[0], True, mix, chunk), pieces))
    return sum(a for a, _ in parts) & M32, sum(b for _, b in parts) & M32


def _pieces(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) ranges of whole chunks, one per worker thread: at least 8 chunks a piece
    (below that a thread's start costs more than it saves), at most TPDIAG_HASH_THREADS (default:
    the CPUs this process may run on, up to 16) pieces."""
    import os

    env = os.environ.get("TPDIAG_HASH_THREADS")
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    workers = max(1, int(env) if env and env.isdigit() else min(16, cpus))
    chunks = -(-n // chunk)
    k = max(1, min(workers, chunks // 8))
    if k == 1:
        return [(0, n)]
    per = -(-chunks // k) * chunk
    return [(s, min(n, s + per)) for s in range(0, n, per)]


_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32"}


_JC2: list = []  # [the uint32 table j * C2 mod 2**32, j < its length]: read-only, grown on demand


def _index_term(m: int):
    """j * C2 mod 2**32 for j < m (uint32, read-only): the index half of every word's hash at slab
    offset 0. Made once a process instead of an arange and two passes a record (np.arange alone
    was ~40% of a small record's check, and a compare's parent checks hundreds)."""
    import numpy as np

    if not _JC2 or len(_JC2[0]) < m:
        t = (np.arange(max(m, CHUNK), dtype=np.uint64) * np.uint64(C2)).astype(np.uint32)  # & M32
        t.flags.writeable = False
        _JC2[:] = [t]
    return _JC2[0]


def _lanes_numpy(v: torch.Tensor, slab_n: int, fb: int, ob: int, one_slab: bool, mix: int,
                 chunk: int) -> tuple[int, int]:
    """lanes_fast's loop in numpy uint32 arithmetic, where products and sums wrap mod 2**32 as
    the definition does: about a third of the int64 torch loop's passes, and no per-op dispatch
    that dominated small records (a compare's parent verifies hundreds of them)."""
    import numpy as np

    raw = v.numpy().view(_UNSIGNED[v.element_size()])
    n = raw.size
    u32 = np.uint32
    c1, c2 = u32(C1), u32(C2)
    jc2 = _index_term(chunk) if one_slab else None
    j = None if one_slab else np.arange(chunk, dtype=np.uint64)
    la = lb = 0
    for s in range(0, n, chunk):
        m = min(n, s + chunk) - s
        y = raw[s:s + m].astype(u32)
        y *= c1
        if one_slab:
            # (j + base) * C2 = j * C2 + base * C2 mod 2**32: the table's j * C2, then the base's
            y += jc2[:m]
            base = (((ob + s) & M32) * C2) & M32
            if base:
                y += u32(base)
        else:
            g = j[:m] + np.uint64(s)
            k = ((g // np.uint64(slab_n)) * np.uint64(fb) + np.uint64(ob) + g % np.uint64(slab_n)).astype(u32)
            k *= c2
            y += k
        if mix == 2:
            x = y ^ ((y << u32(R1)) | (y >> u32(32 - R1)))
            x ^= (y << u32(R2)) | (y >> u32(32 - R2))
            f = y
        else:
            x = y ^ (y >> u32(16))
            x *= u32(C3)
            x ^= x >> u32(15)
            f = x
        la += int(x.sum(dtype=np.uint64))
        x *= f
        lb += int(x.sum(dtype=np.uint64))
    return la, lb


def _stats_chunked(t: torch.Tensor, chunk: int) -> tuple[int, float, list[float]]:
    """_stats_torch's (non-finite count, max |x| over finite x, [sum, sum of squares]) a chunk
    at a time. The count and the max are exact; the float64 sums add in another order than one
    whole-tensor sum, so they agree to rounding (they only feed the approximate norm difference)."""
    flat = t.contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    n = flat.numel()
    buf = torch.empty(max(1, min(chunk, n)), dtype=torch.float64, device=t.device)
    nonfinite, absmax, s1, s2 = 0, 0.0, 0.0, 0.0
    for s in range(0, n, buf.numel()):
        v = buf[:min(n, s + buf.numel()) - s]
        v.copy_(flat[s:s + v.numel()])
        bad = ~torch.isfinite(v)
        nonfinite += int(bad.sum())
        v.masked_fill_(bad, 0.0)
        s1 += float(v.sum())
        s2 += float(torch.dot(v, v))
        absmax = max(absmax, float(v.abs_().max()))
    return nonfinite, absmax, [s1, s2]


def reference_lanes(full: torch.Tensor, mix: int = HASH_VERSION) -> tuple[int, int]:
    """Plain-Python lanes of a whole tensor (slow; tests only)."""
    w, _ = _words(full.cpu())
    la = lb = 0
    for k, v in enumerate(w.tolist()):
        x, f = mix_int((v * C1 + (k & M32) * C2) & M32, mix)
        la = (la + x) & M32
        lb = (lb + x * f) & M32
    return la, lb
