"""TP-invariant RMSNorm under sequence parallelism, and for per-head (q/k) norms on head shards.

With the sequence sharded, the weight grad dgamma = sum over tokens of dy * x_hat is a sum of
per-rank partial sums reduced across ranks: its order changes with TP. Here the sequence is cut
into fixed global groups, each summed by one reduction of the same shape at every TP, and the
groups are added by one fp32 tree across ranks (kernels/tree.py). The input grad is per token
(a reduction over the hidden dim only) and is computed by the same ops at every TP.
"""
from __future__ import annotations

import torch

from tpdiag.kernels.tree import tree_all_reduce, tree_sum


class RMSNormSP(torch.autograd.Function):
    """x_local [..., D] sharded on `group_dim` (the sequence under SP, the heads for a per-head
    q/k norm), w [D] replicated -> y_local; dgamma summed over every dim but the last."""

    @staticmethod
    def forward(ctx, x, w, eps: float, local_groups: int, group_dim: int = 1):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = (xf * r).type_as(x)
        ctx.save_for_backward(x, w, r)
        ctx.local_groups = local_groups
        ctx.group_dim = group_dim
        return y * w

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        xf = x.float()
        xhat = xf * r
        y = xhat.type_as(x)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gy = (g * w).float()
            dx = (r * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            terms = g.float() * y.float()
            dims = tuple(range(terms.dim() - 1))
            parts = [t.contiguous().sum(dim=dims)
                     for t in terms.chunk(ctx.local_groups, dim=ctx.group_dim)]
            dw = tree_all_reduce(tree_sum(parts)).to(w.dtype)
        return dx, dw, None, None, None


def reference_rmsnorm(x, w, eps):
    """float64 reference."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
