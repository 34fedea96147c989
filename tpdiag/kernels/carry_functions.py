"""Autograd Functions whose weight grad goes into grad accumulation's fp32 carry (grad_carry.py):
a norm's weight scale and an embedding lookup. Their forwards are the stock ops (the same bits);
only the weight's grad changes: summed over the tokens in fixed blocks into the carry, returned
as None (the window's close puts it in .grad). The input grads are the stock formulas.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpdiag.kernels import carry_ops
from tpdiag.kernels.grad_carry import live


class CarryScale(torch.autograd.Function):
    """y = n * w (an RMSNorm's last op: the normalised input times its weight, w [D])."""

    @staticmethod
    def forward(ctx, n, w, site):
        ctx.save_for_backward(n, w)
        ctx.site = site
        return n * w

    @staticmethod
    def backward(ctx, g):
        n, w = ctx.saved_tensors
        dn = g * w if ctx.needs_input_grad[0] else None  # mul's own backward: the same bits
        dw = None
        if ctx.needs_input_grad[1]:
            if live(ctx.site):
                # the per-token terms in fp32 (a 16-bit product is exact there), summed in token blocks
                terms = (g.float() * n.float()).reshape(-1, w.shape[-1])
                carry = ctx.site.zeros(w.shape, w.device)
                ctx.site.walk(terms.shape[0], carry_ops.torch_block(terms.device))
                carry_ops.add_colsum(carry, terms)
            else:  # the window closed before this backward: the stock grad
                dw = (g * n).sum(tuple(range(g.dim() - 1)))
        return dn, dw, None


class EmbeddingCarry(torch.autograd.Function):
    """y = w[ids] for a local vocab shard starting at row `offset` (None: the whole vocab):
    ids outside the shard give zero rows (a vocab-parallel embedding's partial output, added
    across ranks by the caller's all-reduce: one rank's row plus zeros, exact)."""

    @staticmethod
    def forward(ctx, ids, w, offset, site):
        if offset is None:
            mask, local = None, ids
            y = F.embedding(ids, w)
        else:
            mask = (ids < offset) | (ids >= offset + w.shape[0])
            local = (ids - offset).masked_fill(mask, 0)
            y = F.embedding(local, w).masked_fill(mask.unsqueeze(-1), 0.0)
        ctx.save_for_backward(local, mask if mask is not None else local)
        ctx.has_mask, ctx.site, ctx.shape = mask is not None, site, w.shape
        return y

    @staticmethod
    def backward(ctx, g):
        local, mask = ctx.saved_tensors
        idx = local.reshape(-1)
        rows = g.reshape(-1, g.shape[-1])
        if ctx.has_mask:
            # another shard's token adds +0.0 to row 0 (its index was set to 0): every rank runs
            # ops of the same shapes (an SPMD op stream for the op probe; selecting this shard's
            # tokens made their count per rank), and the carry is unchanged - it starts at +0.0
            # and a round-to-nearest sum is -0.0 only from two -0.0, so it never holds -0.0, and
            # x + 0.0 == x for every other x
            rows = rows.masked_fill(mask.reshape(-1, 1), 0.0)
        if live(ctx.site):
            carry_ops.add_rows(ctx.site.zeros(ctx.shape, g.device), idx, rows)
            return None, None, None, None
        dw = torch.zeros(ctx.shape, dtype=g.dtype, device=g.device).index_add_(0, idx, rows)
        return None, dw, None, None


class CarryLayerNorm(torch.autograd.Function):
    """y = layer_norm(x) * w + b, the stock kernel (the same bits as F.layer_norm). Backward: dx
    from the stock kernel (its per-row dx, with the weight and bias grads masked off); the
    weight's and bias's grads - sums over tokens, which per micro-batch would be rounded and
    added piece by piece - go into the carry in token blocks:
    dw += sum_t g_t * xhat_t, db += sum_t g_t (fp32 terms, xhat from the forward's mean/rstd)."""

    @staticmethod
    def forward(ctx, x, w, b, shape, eps, site_w, site_b):
        y, mean, rstd = torch.native_layer_norm(x, shape, w, b, eps)
        ctx.save_for_backward(x, w, b, mean, rstd)
        ctx.shape, ctx.sites = shape, (site_w, site_b)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, b, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        site_w, site_b = ctx.sites
        carry_w, carry_b = need_w and live(site_w), need_b and live(site_b)
        # what the stock kernel still computes: dx, and a grad whose window closed (never lost)
        mask = [need_x, need_w and not carry_w, need_b and not carry_b]
        dx = dw = db = None
        if any(mask):
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(g, x, ctx.shape, mean, rstd, w, b, mask)
        if carry_w or carry_b:
            width = w.numel() if w is not None else b.numel()
            gf = g.float().reshape(-1, width)
            block = carry_ops.torch_block(g.device)
            if carry_w:
                xhat = ((x.float() - mean.float()) * rstd.float()).reshape(-1, width)
                site_w.walk(gf.shape[0], block)
                carry_ops.add_colsum(site_w.zeros(w.shape, w.device).view(-1), gf * xhat)
            if carry_b:
                site_b.walk(gf.shape[0], block)
                carry_ops.add_colsum(site_b.zeros(b.shape, b.device).view(-1), gf)
        return dx, dw, db, None, None, None, None


class CarryLinear(torch.autograd.Function):
    """y = x @ w^T for a Linear no plan style shards (replicated: the same at every TP), with the
    batch-invariant GEMM (the Triton kernel, or BLAS in fixed row blocks on the CPU: a token's
    bits do not depend on the rows per call) forward and for dx; w's grad, a sum over tokens,
    goes into the carry in token blocks (a tied head: its own site beside the embedding's)."""

    @staticmethod
    def forward(ctx, x, w, site):
        from tpdiag.kernels.grouped_linear import _mm

        ctx.save_for_backward(x, w)
        ctx.site = site
        return _mm(x, w.t().contiguous())

    @staticmethod
    def backward(ctx, g):
        from tpdiag.kernels.grouped_linear import _carry_wgrad, _mm
        from tpdiag.kernels.vocab_ce_triton import triton_path

        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _mm(g, w) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            if live(ctx.site):
                _carry_wgrad(ctx.site, w, g2, x2, 1, 0, triton_path(x) and x.dtype == w.dtype)
            else:
                dw = torch.matmul(g2.t(), x2)
        return dx, dw, None
