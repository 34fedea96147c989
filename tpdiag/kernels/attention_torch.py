"""The torch path of invariant attention: elementwise ops and fixed reduction trees, fp32 inside.

Why this is invariant: no BLAS in the forward. A score is one fixed pairwise tree over head_dim
of fp32 products (q_i . k_j depends on q_i, k_j and D only); the row max is exact in any order;
exp, the scale and the mask are elementwise. Both sums over keys (the softmax denominator and
sum_j e_ij v_j) go over the keys in blocks of KEY_BLOCK from key 0 - a fixed tree inside a block,
the blocks added in order - and a masked key contributes an exact +0. So query row i's bits
depend on its own q, the keys it may see and D only: not on the number of heads or batch rows
per call (TP, micro-batches), nor on the number of query rows or of masked keys after its own -
one decode query over a cache of t + 1 keys gives row t of the causal prefill bit for bit (the
Triton kernel's structure: key blocks walked in order from 0, masked keys exact zeros).

The backward is explicit (no autograd accumulation), one (batch, query head) at a time on its
own contiguous copies, from the forward's own probabilities: dk and dv of a key/value head are
summed over its query heads in head order, in fp32, so GQA gives the same bits whatever number
of KV heads a rank holds. Used on the CPU, and on any device when an explicit mask is given (the
Triton kernel takes none). Slow (O(L * S * D) elementwise work in tensors): small models.
"""
from __future__ import annotations

import torch

KEY_BLOCK = 16        # keys per block of the sums over keys
_CHUNK_ELEMS = 1 << 22  # products materialised at once (fp32: 16 MiB); chunking is by query rows


def _tree_last(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a pairwise tree that depends only on its length (adjacent
    pairs, an odd last element carried up): elementwise adds, one rounding each."""
    while p.shape[-1] > 1:
        n = p.shape[-1]
        even = n - n % 2
        s = p[..., 0:even:2] + p[..., 1:even:2]
        p = torch.cat([s, p[..., even:]], dim=-1) if n % 2 else s
    return p[..., 0]


def _key_sum(p: torch.Tensor) -> torch.Tensor:
    """p [..., S, n] -> [..., n]: keys zero-padded to whole blocks of KEY_BLOCK, each block a
    fixed tree, the blocks added in order from key 0. Trailing zero keys change nothing (x + 0
    is x), so a row with more masked keys after its last visible one gets the same bits."""
    S = p.shape[-2]
    pad = (-S) % KEY_BLOCK
    if pad:
        p = torch.cat([p, p.new_zeros(*p.shape[:-2], pad, p.shape[-1])], dim=-2)
    sums = _tree_last(p.unflatten(-2, (-1, KEY_BLOCK)).transpose(-1, -2))  # [..., blocks, n]
    acc = sums[..., 0, :]
    for j in range(1, sums.shape[-2]):
        acc = acc + sums[..., j, :]
    return acc


def _bias(mask, B: int, H: int, L: int, S: int, causal: bool, device) -> torch.Tensor | None:
    """The additive fp32 bias, broadcast to [B, H, L, S] (a view): -inf where masked out."""
    out = None
    if causal:
        # torch's is_causal: top-left aligned, query i sees keys j <= i
        keep = torch.ones(L, S, dtype=torch.bool, device=device).tril()
        out = torch.zeros(L, S, dtype=torch.float32, device=device).masked_fill(~keep, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            m = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(~mask, float("-inf"))
        else:
            m = mask.to(torch.float32)
        out = m if out is None else out + m
    return None if out is None else torch.broadcast_to(out, (B, H, L, S))


def _weights(q, k, scale: float, bias):
    """q [B, H, l, D], k [B, H, S, D] (fp32, GQA already expanded), bias [B, H, l, S] or None ->
    (e [B, H, l, S] = exp(score - row max), 0 where masked; den [B, H, l] = key sum of e)."""
    s = _tree_last(q[..., :, None, :] * k[..., None, :, :]) * scale
    if bias is not None:
        s = s + bias
    m = s.amax(dim=-1, keepdim=True)
    # a row whose keys are all masked (a padded sequence): e = 0 everywhere (torch's SDPA gives 0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    return e, _key_sum(e[..., None])[..., 0]


def _chunks(B: int, H: int, L: int, S: int, D: int):
    rows = max(1, min(L, _CHUNK_ELEMS // max(1, B * H * S * D)))
    for i in range(0, L, rows):
        yield slice(i, min(L, i + rows))


def _expand_kv(t, rep: int):
    return t.to(torch.float32).repeat_interleave(rep, dim=1) if rep > 1 else t.to(torch.float32)


def forward(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    B, H, L, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    bias = _bias(mask, B, H, L, S, causal, q.device)  # first: it checks the mask's shape
    if S == 0:  # no keys: zeros, as torch's SDPA gives
        return torch.zeros(B, H, L, Dv, dtype=q.dtype, device=q.device)
    rep = H // Hk
    qf, kf, vf = q.to(torch.float32), _expand_kv(k, rep), _expand_kv(v, rep)
    out = torch.empty(B, H, L, Dv, dtype=q.dtype, device=q.device)
    for rows in _chunks(B, H, L, S, max(D, Dv)):
        e, den = _weights(qf[:, :, rows], kf, scale, None if bias is None else bias[:, :, rows])
        # + 0.0 turns a -0 product (0 * a negative v, an underflow) into +0: a masked key's
        # product is then the same +0 as a padded key's
        num = _key_sum(e[..., None] * vf[:, :, None] + 0.0)
        o = num / den[..., None]
        out[:, :, rows] = torch.where(den[..., None] == 0, torch.zeros_like(o), o).to(q.dtype)
    return out


def _probs(q, k, scale: float, bias) -> torch.Tensor:
    """The forward's probabilities e / den, [B, H, L, S] (0 on fully masked rows)."""
    B, H, L, D = q.shape
    parts = []
    for rows in _chunks(B, H, L, k.shape[2], D):
        e, den = _weights(q[:, :, rows], k, scale, None if bias is None else bias[:, :, rows])
        den = den[..., None]
        parts.append(torch.where(den == 0, torch.zeros_like(e), e / torch.where(den == 0, 1.0, den)))
    return torch.cat(parts, dim=2)


def backward(do, q, k, v, mask, causal: bool, scale: float):
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if S == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), torch.zeros_like(k), torch.zeros_like(v)
    rep = H // Hk
    bias = _bias(mask, B, H, L, S, causal, q.device)
    p_all = _probs(q.to(torch.float32), _expand_kv(k, rep), scale, bias)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for b in range(B):
        for h in range(H):  # query heads of one KV head in ascending order: a fixed sum order
            qh = q[b, h].to(torch.float32).contiguous()
            kh = k[b, h // rep].to(torch.float32).contiguous()
            vh = v[b, h // rep].to(torch.float32).contiguous()
            doh = do[b, h].to(torch.float32).contiguous()
            p = p_all[b, h].contiguous()
            dp = doh @ vh.t()
            # softmax backward: dS = P * (dP - rowsum(dP * P))
            ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
            dq[b, h] = ((ds @ kh) * scale).to(q.dtype)
            dk[b, h // rep] += (ds.t() @ qh) * scale
            dv[b, h // rep] += p.t() @ doh
    return dq, dk.to(k.dtype), dv.to(v.dtype)
