"""TP-invariant RMSNorm under sequence parallelism, and for per-head (q/k) norms on head shards.

With the sequence sharded, the weight grad dgamma = sum over tokens of dy * x_hat is a sum of
per-rank partial sums reduced across ranks: its order changes with TP. Here the sequence is cut
into fixed global groups, each summed by one reduction of the same shape at every TP, and the
groups are added by one fp32 tree across ranks (kernels/tree.py). The input grad is per token
(a reduction over the hidden dim only) and is computed by the same ops at every TP.
On CUDA the row means and the per-group dgamma sums are Triton kernels (norm_grad_triton.py);
on the CPU, torch ops. Each path is TP-invariant in its own fixed order.
"""
from __future__ import annotations

import torch

from tpdiag.kernels import norm_grad_triton as ngt
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

        if ngt.triton_path(x):
            # One program per row walks D in fixed steps: a row's bits never depend on the
            # other rows of the call, so no per-group calls are needed.
            r = ngt.row_rstd(x, eps)
        else:
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
        k = ctx.local_groups
        gd = ctx.group_dim
        use_triton = ngt.triton_path(x) and ngt.triton_path(g)
        if ctx.needs_input_grad[0]:
            gy = (g * w).float()
            if use_triton:
                dots = ngt.row_dot_mean(gy, xhat)
            else:
                dots = torch.cat([(a.contiguous() * b.contiguous()).mean(-1, keepdim=True)
                                  for a, b in zip(gy.chunk(k, dim=gd), xhat.chunk(k, dim=gd))], dim=gd)
            dx = (r * (gy - xhat * dots)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if use_triton:
                parts = list(ngt.group_col_sums(g, y, k, gd).unbind(0))
            else:
                terms = g.float() * y.float()
                dims = tuple(range(terms.dim() - 1))
                parts = [t.contiguous().sum(dim=dims) for t in terms.chunk(k, dim=gd)]
            dw = tree_all_reduce(tree_sum(parts), w.dtype)
        return dx, dw, None, None, None


class OffsetRMSNormSP(torch.autograd.Function):
    """Gemma's and Qwen3-Next's RMSNorm, (x_hat * (1 + w.float())).type_as(x) with x_hat in
    float32 (their q_norm/k_norm), on x_local sharded on `group_dim`: the forward is that formula's
    bits; the row statistics are taken group by group as RMSNormSP's, and dgamma = sum of
    g.float() * x_hat (float32, as the stock backward of the formula sums it) by fixed groups added
    by one fp32 tree across ranks. Torch ops on every device (a per-head norm is small)."""

    @staticmethod
    def forward(ctx, x, w, eps: float, local_groups: int, group_dim: int = 1):
        xf = x.float()
        r = torch.cat([torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
                       for xg in xf.chunk(local_groups, dim=group_dim)], dim=group_dim)
        ctx.save_for_backward(x, w, r)
        ctx.local_groups = local_groups
        ctx.group_dim = group_dim
        return (xf * r * (1.0 + w.float())).type_as(x)

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        xhat = x.float() * r
        gf = g.float()
        k, gd = ctx.local_groups, ctx.group_dim
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gy = gf * (1.0 + w.float())
            dots = torch.cat([(a.contiguous() * b.contiguous()).mean(-1, keepdim=True)
                              for a, b in zip(gy.chunk(k, dim=gd), xhat.chunk(k, dim=gd))], dim=gd)
            dx = (r * (gy - xhat * dots)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            terms = gf * xhat
            dims = tuple(range(terms.dim() - 1))
            parts = [t.contiguous().sum(dim=dims) for t in terms.chunk(k, dim=gd)]
            dw = tree_all_reduce(tree_sum(parts), w.dtype)
        return dx, dw, None, None, None


def reference_rmsnorm(x, w, eps):
    """float64 reference."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
