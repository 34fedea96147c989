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


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's raw bits as int64 words in [0, 2**32), flat; and words per element."""
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    if t.dtype == torch.bool or size == 1:
        return t.view(torch.uint8).to(torch.int64), 1
    if size == 2:
        return t.view(torch.int16).to(torch.int64) & 0xFFFF, 1
    if size == 4:
        return t.view(torch.int32).to(torch.int64) & M32, 1
    if size == 8:
        return t.view(torch.int32).to(torch.int64) & M32, 2
    raise TypeError(f"cannot hash dtype {t.dtype}")


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
    if out is None:
        return ints, sums
    if len(out) == 3:  # a HashBuffer slot
        out[0][out[2]].copy_(ints)
        out[1][out[2]].copy_(sums)
    else:
        out[0].copy_(ints)
        out[1].copy_(sums)
    return out


def reference_lanes(full: torch.Tensor, mix: int = HASH_VERSION) -> tuple[int, int]:
    """Plain-Python lanes of a whole tensor (slow; tests only)."""
    w, _ = _words(full.cpu())
    la = lb = 0
    for k, v in enumerate(w.tolist()):
        x, f = mix_int((v * C1 + (k & M32) * C2) & M32, mix)
        la = (la + x) & M32
        lb = (lb + x * f) & M32
    return la, lb
