"""A reduction order that does not depend on the TP degree.

The reduced dimension (K of a row-parallel GEMM, N of a column-parallel dgrad, the vocab of a
softmax) is cut into G fixed groups in GLOBAL coordinates (G = 8 by default: the largest TP
this supports). Each group is reduced by one call of identical shape at every TP - identical
shapes take identical kernel paths, so identical bits - and the G group results are summed in
fp32 by a balanced pairwise tree. At TP=T (a power of two dividing G) each rank holds G/T
adjacent groups, which form a subtree; the ranks' subtree roots are all-gathered and the tree
is finished in rank order. The sum is therefore the same tree at every TP: bitwise equal.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from tpdiag.errors import BadInput


def n_groups() -> int:
    return int(os.environ.get("TPDIAG_TREE_GROUPS", "8"))


def check(dim: int, world: int, what: str) -> int:
    g = n_groups()
    if g & (g - 1) or world & (world - 1) or g % world:
        raise BadInput(f"{what}: the invariant reduction needs a power-of-two TP dividing "
                       f"{g} groups (TPDIAG_TREE_GROUPS); got TP={world}")
    if dim % g:
        raise BadInput(f"{what}: reduced dimension {dim} is not divisible by {g} groups")
    return g


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Balanced pairwise sum of a power-of-two list, adjacent pairs first."""
    n = len(parts)
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {n}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


_LOCAL = [0]


@contextmanager
def local_only():
    """Compute as one rank: for tensors every rank already holds whole (replicated logits)."""
    _LOCAL[0] += 1
    try:
        yield
    finally:
        _LOCAL[0] -= 1


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() and not _LOCAL[0] else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() and not _LOCAL[0] else 0


class TreeAllReduce(torch.autograd.Function):
    """Sum of every rank's subtree root, finished as the top of one tree (rank order).

    Backward: d(sum)/d(part) = 1, and the incoming grad is replicated, so each rank's part
    simply receives it - no communication, nothing reordered.
    """

    @staticmethod
    def forward(ctx, part: torch.Tensor) -> torch.Tensor:
        w = world_size()
        if w == 1:
            return part.clone()
        import torch.distributed as dist

        parts = [torch.empty_like(part) for _ in range(w)]
        dist.all_gather(parts, part.contiguous(), group=_group())
        return tree_sum(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad


def tree_all_reduce(part: torch.Tensor) -> torch.Tensor:
    return TreeAllReduce.apply(part)


def reference_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """float64 reference for tests: what the tree approximates."""
    return torch.stack([p.to(torch.float64) for p in parts]).sum(0)
