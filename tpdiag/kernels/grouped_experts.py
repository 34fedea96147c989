"""The autograd pieces of TP-invariant MoE experts (fixes/moe.py installs them).

transformers' `moe_tp_experts` cuts every expert's intermediate dimension I across ranks: each
rank runs its slice of every expert, and the ranks' partial outputs (already weighted by the
router and summed over the token's experts) are all-reduced; in backward the partial grads of
the experts' input and of the routing weights are all-reduced too. Those are reductions over I
in a TP-dependent order. Here I is cut into the run's G fixed groups in global coordinates
(kernels/tree.py): every group runs the experts' own forward on its slice - one call of the same
shape at every TP, so the same bits - and the G group outputs are summed in fp32 by the fixed
tree, the rank's groups as a subtree, finished across ranks in rank order. The grads of the
experts' input and routing weights take the same tree in backward (FanOut).
"""
from __future__ import annotations

import torch

from tpdiag.kernels.tree import tree_reduce_scattered, tree_sum, world_size


class FanOut(torch.autograd.Function):
    """x -> n aliases of x, one per local group. Backward: the n group grads summed in fp32 by
    the tree (the rank's subtree), finished across ranks in rank order, rounded once - the
    replicated input's grad, the same tree at every TP (replaces the stock all-reduce)."""

    @staticmethod
    def forward(ctx, x, n: int):
        ctx.meta = (x.shape, x.dtype, x.device)
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.meta
        parts = [g.float() if g is not None else torch.zeros(shape, dtype=torch.float32, device=device)
                 for g in grads]
        root = tree_sum(parts)
        if world_size() > 1:
            return tree_reduce_scattered(root, dtype), None
        return root.to(dtype), None


def fan_out(x: torch.Tensor, n: int) -> tuple:
    return FanOut.apply(x, n)


class GroupSlices(torch.autograd.Function):
    """A local expert weight -> its n local groups along `dim`. The dim is `sf` equal blocks
    (sf=2: a packed [gate; up]) and group j is chunk j of every block, concatenated in block
    order - at TP=T rank r's local weight is chunk r of every block (a _StridedShard(dim, sf)),
    so its group j is the global group r*n + j. Backward puts each group's grad back in its place
    (a concatenation, no additions: exact)."""

    @staticmethod
    def forward(ctx, w, dim: int, sf: int, n: int):
        dim = dim % w.dim()
        ctx.meta = (dim, sf, n, w.shape)
        if n == 1:  # one group: the whole local weight (the run's largest degree), no copy
            return (w.view_as(w),)
        chunks = [b.chunk(n, dim) for b in w.chunk(sf, dim)]
        # contiguous like the whole local weight of the largest degree: the same memory layout
        # for the group's kernels at every degree (a strided view may take another GEMM path)
        return tuple(torch.cat([blk[j] for blk in chunks], dim).contiguous() for j in range(n))

    @staticmethod
    def backward(ctx, *grads):
        dim, sf, n, shape = ctx.meta
        piece = list(shape)
        piece[dim] = shape[dim] // n
        c = shape[dim] // (sf * n)
        ref = next(g for g in grads if g is not None)
        gs = [g if g is not None else ref.new_zeros(piece) for g in grads]
        whole = torch.cat([g.narrow(dim, b * c, c) for b in range(sf) for g in gs], dim)
        return whole, None, None, None


def group_slices(w: torch.Tensor, dim: int, sf: int, n: int) -> tuple:
    return GroupSlices.apply(w, dim, sf, n)
