"""Order-aware 64-bit hashes of tensors' raw bits, computed where the tensor lives.

One definition everywhere (kernels/record_hash.py): two 32-bit lanes summed over elements mixed
with their positions. Because the lanes are sums, a shard's lanes computed with its global
positions add up to the whole tensor's - hash-first capture compares TP=N with TP=1 without
ever gathering a tensor. The hash also covers dtype and (whole) shape.
"""
from __future__ import annotations

import hashlib

import torch

M32 = 0xFFFFFFFF


def _head(dtype: str, shape) -> int:
    # hashlib, not hash(): Python's str hash changes from process to process
    return int.from_bytes(hashlib.sha256(f"{dtype}{tuple(shape)}".encode()).digest()[:8], "little")


def hash_of_lanes(lane_a: int, lane_b: int, dtype: str, shape) -> str:
    """16 hex digits from a whole tensor's lanes, its dtype ('float32') and its shape."""
    v = (lane_a & M32) | ((lane_b & M32) << 32)
    return format(v ^ _head(dtype.replace("torch.", ""), shape), "016x")


def tensor_hash(t: torch.Tensor) -> str:
    """The hash of a whole tensor (one host sync)."""
    from tpdiag.kernels.record_hash import shard_lanes

    ints, _ = shard_lanes(t.detach())
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
