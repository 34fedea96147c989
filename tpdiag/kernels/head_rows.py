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
    """xhat [..., H, D] float32, w [H, D] -> w.float() * xhat; dw summed head by head.

    site: grad accumulation's carry of the weight (kernels/grad_carry.py) or None: inside an open
    window each head's rows go into its row of the fp32 carry in fixed token blocks, so micro-batches
    give one sum's bits too (its shape is the local [H, D]: a DTensor weight's carry is its shard)."""

    @staticmethod
    def forward(ctx, xhat, w, site=None):
        ctx.save_for_backward(xhat, w)
        ctx.site = site
        return w.to(torch.float32) * xhat

    @staticmethod
    def backward(ctx, g):
        from tpdiag.kernels import carry_ops
        from tpdiag.kernels.grad_carry import live

        xhat, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g * w.to(torch.float32)
        if ctx.needs_input_grad[1]:
            terms = (g * xhat).reshape(-1, *w.shape)
            if live(ctx.site):
                carry = ctx.site.zeros(w.shape, w.device)
                ctx.site.walk(terms.shape[0], carry_ops.torch_block(terms.device))
                for h in range(w.shape[0]):
                    carry_ops.add_colsum(carry[h], terms[:, h])
            else:
                dw = torch.stack([terms[:, h].contiguous().sum(0) for h in range(w.shape[0])]).to(w.dtype)
        return dx, dw, None


def reference_head_layernorm(x, w, eps):
    """float64 reference of Cohere's LayerNorm (no bias, one weight row per head)."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    return (xd - mean) * torch.rsqrt((xd - mean).pow(2).mean(-1, keepdim=True) + eps) * w.double()
