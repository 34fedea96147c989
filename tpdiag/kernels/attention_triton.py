"""The Triton path of invariant attention (CUDA; the Triton interpreter runs it on the CPU).

Why it is invariant and deterministic: one program per (batch, head, row block) - the grid
only gets longer with more heads or batch rows, and a program reads nothing but its own
head's rows, with tiles fixed per (head_dim, dtype), never per B or H. The forward walks
every key block from 0 upwards into one fp32 accumulator (never split-KV). The backward
(attention_triton_bwd.py) has no atomics: a dq pass and a dk/dv pass, each summing in one
fixed order per program. fp32 inputs use IEEE fp32 products (no TF32). Imports Triton at import time:
import this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpdiag.kernels.attention_triton_common import (  # noqa: F401 (AttnConfig, CONFIGS: this module's API)
    CONFIGS, LOG2E, AttnConfig, _last_dim_unit, _load_rows, _mm, _prec, descriptors, tma_ok)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, lo, hi, S, qk_scale,
               DIAG: tl.constexpr, EVEN: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               PREC: tl.constexpr, TMA: tl.constexpr):
    # key blocks lo, lo+BN, ... < hi in ascending order; DIAG: blocks that need the causal mask
    offs_n = tl.arange(0, BN)
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n
        k = _load_rows(k_src, b, hk, start_n, skn, S, BN, D, EVEN, TMA)
        v = _load_rows(v_src, b, hk, start_n, svn, S, BN, D, EVEN, TMA)
        s = _mm(q, tl.trans(k), PREC) * qk_scale
        if DIAG:
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        if not EVEN:
            s = tl.where(cols[None, :] < S, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                H, REP, L, S, qk_scale,
                CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                PREC: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr):
    # largest causal row blocks first: they have the most work
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // REP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q_ptr = Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :]
    if EVEN:
        q = tl.load(q_ptr)
    else:
        q = tl.load(q_ptr, mask=offs_m[:, None] < L, other=0.0)
    if TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b * skb + hk * skh
        v_src = V + b * svb + hk * svh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        # blocks left of the diagonal need no mask; BM is a multiple of BN
        diag = tl.minimum(pid_m * BM, S)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, 0, diag, S,
                                   qk_scale, False, EVEN, BN, D, PREC, TMA)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, diag,
                                   tl.minimum((pid_m + 1) * BM, S), S, qk_scale, True, EVEN, BN, D, PREC, TMA)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, 0, S, S,
                                   qk_scale, False, EVEN, BN, D, PREC, TMA)
    acc = acc / l_i[:, None]
    o_ptr = O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :]
    if EVEN:
        tl.store(o_ptr, acc.to(O.dtype.element_ty))
        tl.store(LSE + bh * L + offs_m, m_i + tl.math.log2(l_i))
    else:
        tl.store(o_ptr, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < L)
        tl.store(LSE + bh * L + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < L)


def forward(q, k, v, causal: bool, scale: float, cfg: AttnConfig | None = None):
    """q [B, H, L, D], k/v [B, Hk, S, D] -> (o [B, H, L, D] contiguous, lse [B*H, L] fp32, log2)."""
    cfg = cfg or CONFIGS[q.dtype]
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    o = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B * H, L, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(L, cfg.fwd_m), B * H)
    tma = tma_ok(cfg, k, v)
    kd, vd = descriptors(tma, cfg.fwd_n, k, v)
    _fwd_kernel[grid](q, kd, vd, o, lse, q.stride(0), q.stride(1), q.stride(2),
                      k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                      o.stride(0), o.stride(1), o.stride(2), H, H // Hk, L, S, scale * LOG2E,
                      CAUSAL=causal, BM=cfg.fwd_m, BN=cfg.fwd_n, D=D, PREC=_prec(q),
                      EVEN=L % cfg.fwd_m == 0 and S % cfg.fwd_n == 0, TMA=tma,
                      num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, lse


def backward(do, q, k, v, o, lse, causal: bool, scale: float, cfg: AttnConfig | None = None):
    """-> (dq [B, H, L, D], dk, dv [B, Hk, S, D])"""
    from tpdiag.kernels import attention_triton_bwd

    return attention_triton_bwd.backward(do, q, k, v, o, lse, causal, scale, cfg or CONFIGS[q.dtype])
