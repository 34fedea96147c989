"""The torch path of invariant attention: one (batch, query head) at a time, fp32 inside.

Why this is invariant: every (b, h) is computed by the same sequence of 2-D ops on its own
contiguous copies - [L, D] @ [D, S] scores, a row softmax, [L, S] @ [S, D] - whose shapes depend
only on L, S and D, never on how many heads or batch rows share the call. The backward is
explicit (no autograd accumulation): dk and dv of a key/value head are summed over its query
heads in head order, in fp32, so GQA gives the same bits whatever number of KV heads a rank
holds. Used on the CPU, and on any device when an explicit mask is given (the Triton kernel
takes none). Slow (a Python loop over B * H); meant for small models and masks.
"""
from __future__ import annotations

import torch


def _bias(mask, b: int, h: int, L: int, S: int, causal: bool, device) -> torch.Tensor | None:
    """The additive fp32 bias of one (b, h): -inf where masked out (bool False / causal)."""
    out = None
    if causal:
        # torch's is_causal: top-left aligned, query i sees keys j <= i
        keep = torch.ones(L, S, dtype=torch.bool, device=device).tril()
        out = torch.zeros(L, S, dtype=torch.float32, device=device).masked_fill(~keep, float("-inf"))
    if mask is not None:
        m = mask.expand(*mask.shape[:-2], L, S) if mask.dim() >= 2 else mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m[b if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0]
        if m.dtype == torch.bool:
            m = torch.zeros(L, S, dtype=torch.float32, device=device).masked_fill(~m, float("-inf"))
        else:
            m = m.to(torch.float32)
        out = m if out is None else out + m
    return out


def _probs(q, k, scale, bias):
    s = (q @ k.t()) * scale
    if bias is not None:
        s = s + bias
    p = torch.softmax(s, dim=-1)
    if bias is not None:
        # a query row whose keys are all masked out (a padded sequence) is 0/0: torch's SDPA
        # returns zeros for it (and zero grads), not NaN
        p = p.masked_fill(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0)
    return p


def forward(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    B, H, L, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = H // Hk
    out = torch.empty(B, H, L, Dv, dtype=q.dtype, device=q.device)
    for b in range(B):
        for h in range(H):
            qh = q[b, h].to(torch.float32).contiguous()
            kh = k[b, h // rep].to(torch.float32).contiguous()
            vh = v[b, h // rep].to(torch.float32).contiguous()
            p = _probs(qh, kh, scale, _bias(mask, b, h, L, S, causal, q.device))
            out[b, h] = (p @ vh).to(q.dtype)
    return out


def backward(do, q, k, v, mask, causal: bool, scale: float):
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    rep = H // Hk
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for b in range(B):
        for h in range(H):  # query heads of one KV head in ascending order: a fixed sum order
            qh = q[b, h].to(torch.float32).contiguous()
            kh = k[b, h // rep].to(torch.float32).contiguous()
            vh = v[b, h // rep].to(torch.float32).contiguous()
            doh = do[b, h].to(torch.float32).contiguous()
            p = _probs(qh, kh, scale, _bias(mask, b, h, L, S, causal, q.device))
            dp = doh @ vh.t()
            # softmax backward: dS = P * (dP - rowsum(dP * P))
            ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
            dq[b, h] = ((ds @ kh) * scale).to(q.dtype)
            dk[b, h // rep] += (ds.t() @ qh) * scale
            dv[b, h // rep] += p.t() @ doh
    return dq, dk.to(k.dtype), dv.to(v.dtype)
