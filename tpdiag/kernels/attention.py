"""invariant attention: scaled-dot-product attention whose bits do not depend on the number of
heads or batch rows per call, with a deterministic backward (dq, dk, dv).

`invariant_sdpa` has F.scaled_dot_product_attention's signature. CUDA tensors without an
explicit mask, with a scale > 0, run the Triton kernels (attention_triton.py); everything else
(CPU, masks, a head_dim the kernel does not tile) runs the per-(batch, head) torch path
(attention_torch.py). The choice depends on device, dtype, head_dim, the mask and the sign of
the scale only - never on B or H - so one call and its head or batch slices always take the
same path. Unsupported arguments raise BadInput naming what is unsupported: nothing falls back
to the stock SDPA kernels.
"""
from __future__ import annotations

import math

import torch

from tpdiag.errors import BadInput
from tpdiag.kernels import attention_torch

TRITON_HEAD_DIMS = (16, 32, 64, 128)


def use_triton(q: torch.Tensor, mask) -> bool:
    return (q.is_cuda and mask is None and q.shape[-1] in TRITON_HEAD_DIMS
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


_OPS = None


def _ops():
    """Register the kernels as torch custom ops (once): a TorchDispatchMode (tpdiag's op probe)
    then sees one op per call with the whole head shard as its output, not the per-head ops
    inside, which hold other heads at other TP degrees."""
    global _OPS
    if _OPS is not None:
        return _OPS
    lib = "tpdiag"

    def fwd_torch(q, k, v, mask, causal, scale):
        return attention_torch.forward(q, k, v, mask, causal, scale)

    def bwd_torch(do, q, k, v, mask, causal, scale):
        return attention_torch.backward(do, q, k, v, mask, causal, scale)

    def fwd_triton(q, k, v, causal, scale, cfg):
        from tpdiag.kernels import attention_triton

        return attention_triton.forward(q, k, v, causal, scale, attention_triton.AttnConfig(*cfg))

    def bwd_triton(do, q, k, v, o, lse, causal, scale, cfg):
        from tpdiag.kernels import attention_triton, attention_triton_bwd

        return attention_triton_bwd.backward(do, q, k, v, o, lse, causal, scale, attention_triton.AttnConfig(*cfg))

    cl = torch.library.custom_op
    _OPS = {
        "fwd_torch": cl(f"{lib}::inv_attn_fwd_torch", fwd_torch, mutates_args=(),
                        schema="(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor"),
        "bwd_torch": cl(f"{lib}::inv_attn_bwd_torch", bwd_torch, mutates_args=(),
                        schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale)"
                               " -> (Tensor, Tensor, Tensor)"),
        "fwd_triton": cl(f"{lib}::inv_attn_fwd_triton", fwd_triton, mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale, int[] cfg) -> (Tensor, Tensor)"),
        "bwd_triton": cl(f"{lib}::inv_attn_bwd_triton", bwd_triton, mutates_args=(),
                         schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
                                "float scale, int[] cfg) -> (Tensor, Tensor, Tensor)"),
    }
    return _OPS


class _Attn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, triton_cfg):
        ops = _ops()
        if triton_cfg is not None:
            cfg = [int(x) for x in triton_cfg.to_dict().values()]
            o, lse = ops["fwd_triton"](q, k, v, causal, scale, cfg)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.cfg = cfg
        else:
            o = ops["fwd_torch"](q, k, v, mask, causal, scale)
            ctx.save_for_backward(q, k, v)
            ctx.cfg = None
        ctx.mask, ctx.causal, ctx.scale = mask, causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        ops = _ops()
        if ctx.cfg is not None:
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = ops["bwd_triton"](do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale, ctx.cfg)
        else:
            q, k, v = ctx.saved_tensors
            dq, dk, dv = ops["bwd_torch"](do, q, k, v, ctx.mask, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


def _check(q, k, v, attn_mask, dropout_p, enable_gqa) -> None:
    if dropout_p:
        raise BadInput(f"invariant-attention: dropout_p={dropout_p} is not supported (only 0.0)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise BadInput("invariant-attention: only 4-D [batch, heads, seq, head_dim] q/k/v are supported, "
                       f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise BadInput(f"invariant-attention: q/k/v dtypes {q.dtype}, {k.dtype}, {v.dtype} are not supported "
                       "(one of float32, bfloat16, float16)")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise BadInput(f"invariant-attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                       f"v {tuple(v.shape)}")
    H, Hk = q.shape[1], k.shape[1]
    if Hk == 0 and H:
        raise BadInput(f"invariant-attention: {H} query heads but no key/value heads (k {tuple(k.shape)}): "
                       "were the KV heads sharded over more ranks than there are?")
    if H != Hk and not (enable_gqa and H % Hk == 0):
        raise BadInput(f"invariant-attention: {H} query heads vs {Hk} key/value heads needs enable_gqa=True "
                       "and a divisible head count")
    if attn_mask is not None:
        if attn_mask.requires_grad:
            raise BadInput("invariant-attention: an attn_mask that requires grad is not supported")
        if attn_mask.dim() > 4 or attn_mask.dtype not in (torch.bool, q.dtype, torch.float32):
            raise BadInput(f"invariant-attention: attn_mask of shape {tuple(attn_mask.shape)} and dtype "
                           f"{attn_mask.dtype} is not supported (bool or additive float, up to 4-D)")


def invariant_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, triton_cfg=None):
    _check(query, key, value, attn_mask, dropout_p, enable_gqa)
    if attn_mask is not None and is_causal:
        raise BadInput("invariant-attention: attn_mask together with is_causal=True is not supported "
                       "(torch rejects it too)")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if query.shape[1] == 0:  # no heads: an empty output, as torch's SDPA gives (kept in the graph)
        B, _, L, _ = query.shape
        return (query.sum(-1, keepdim=True) * 0).expand(B, 0, L, value.shape[-1])
    cfg = None
    # the Triton forward takes the max of the unscaled scores: right only for a scale > 0; its
    # tiles take V's head_dim as Q's (a different one goes the torch way)
    if use_triton(query, attn_mask) and sc > 0 and value.shape[-1] == query.shape[-1]:
        from tpdiag.kernels import attention_triton

        cfg = triton_cfg or attention_triton.config_for(query.dtype, query.shape[-1])
    return _Attn.apply(query, key, value, attn_mask, bool(is_causal), sc, cfg)


def reference_sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """float64 math reference (for correctness checks only)."""
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * sc
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    return torch.softmax(s, dim=-1) @ v
