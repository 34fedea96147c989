"""An order-aware 64-bit hash of a tensor's raw bits, computed where the tensor lives.

Each element's bit pattern is mixed with its position (splitmix64-style constants), so a
permutation or a single flipped bit changes the hash; the mixed words are added with int64
wrap-around, which is associative - the hash does not depend on how the device orders the sum.
Used to fingerprint every record cheaply (on the GPU for GPU tensors) and to detect a record
file edited after the run.
"""
from __future__ import annotations

import hashlib

import torch

from tpdiag.diff.bits import raw_bits

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64


def tensor_hash(t: torch.Tensor) -> str:
    """16 hex digits; also covers dtype and shape."""
    x = raw_bits(t.detach()).reshape(-1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    x = x.to(torch.int64)
    idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64)
    h = (x ^ (idx * _M1)) * _M2
    h = h ^ (h >> 31)
    total = int(h.sum()) if x.numel() else 0
    # hashlib, not hash(): Python's str hash changes from process to process
    head = int.from_bytes(hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode()).digest()[:8], "little")
    return format((total ^ head) & ((1 << 64) - 1), "016x")
