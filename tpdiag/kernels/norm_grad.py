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
        # The per-token mean over the hidden dim is computed group by group: every call has
        # the shape of one global group at every TP. A GPU row reduction over [S/4, D] rows
        # may pick another kernel than over [S, D] (seen on H200 at TP=4, fp32).
        def rstd(xg):
            return torch.rsqrt(xg.float().pow(2).mean(-1, keepdim=True) + eps)

        r = torch.cat([rstd(xg.contiguous()) for xg in x.chunk(local_groups, dim=group_dim)],
                      dim=group_dim)
        y = (x.float() * r).type_as(x)
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
            k = ctx.local_groups
            gd = ctx.group_dim
            dots = torch.cat([(a.contiguous() * b.contiguous()).mean(-1, keepdim=True)
                              for a, b in zip(gy.chunk(k, dim=gd), xhat.chunk(k, dim=gd))], dim=gd)
            dx = (r * (gy - xhat * dots)).to(x.dtype)
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
