"""A per-head norm weight ([heads, head_dim]: Cohere's q_norm/k_norm) whose grad does not depend
on how many heads share the call.

The stock backward of `w.float() * xhat` (xhat [..., heads, head_dim]) sums g * xhat over every
token in one reduction over the outer dims; on the CPU its order follows the inner width
heads * head_dim, so the rank's half of the heads at TP=2 sums each column another way than TP=1
(32 ULP on a tiny Cohere's k_norm grad). Here every head's rows are summed by their own call of
shape [tokens, head_dim], the same at every TP. The weight's rows are the rank's own heads, so no
cross-rank sum is needed. Forward and input grad are the stock elementwise products, bit for bit.
"""
from __future__ import annotations

import torch


class HeadRowsScale(torch.autograd.Function):
    """xhat [..., H, D] float32, w [H, D] -> w.float() * xhat; dw summed head by head."""

    @staticmethod
    def forward(ctx, xhat, w):
        ctx.save_for_backward(xhat, w)
        return w.to(torch.float32) * xhat

    @staticmethod
    def backward(ctx, g):
        xhat, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g * w.to(torch.float32)
        if ctx.needs_input_grad[1]:
            terms = (g * xhat).reshape(-1, *w.shape)
            dw = torch.stack([terms[:, h].contiguous().sum(0) for h in range(w.shape[0])]).to(w.dtype)
        return dx, dw


def reference_head_layernorm(x, w, eps):
    """float64 reference of Cohere's LayerNorm (no bias, one weight row per head)."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    return (xd - mean) * torch.rsqrt((xd - mean).pow(2).mean(-1, keepdim=True) + eps) * w.double()
