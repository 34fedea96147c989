"""The one-pass deterministic backward of invariant attention (AttnConfig.bwd_ordered=1).

One program per (batch, KV head, key block) computes P and dS once per (query, key) block
pair and gives each product to all three gradients: dk and dv in registers, and dq through an
fp32 buffer in global memory. An atomic dq (FlashAttention) adds the key blocks' partials in
whatever order they arrive, so its bits change run to run. Here the partials of one query block
are added in key-block order 0, 1, 2, ...: the key block n program waits until that query
block's counter reads n, adds its partial, and sets the counter to n + 1. Key block 0 stores
without reading and the last key block writes dq itself, rounded once. So dq is the same sum
in the same order for any grid, number of heads or batch rows - and 5 block products per pair
where the two-pass backward (attention_triton_bwd.py) needs 7.

Why it cannot deadlock: the grid puts the (batch, KV head) axis fastest, so the program of key
block n - 1 of a head is launched before that of key block n (CUDA launches blocks in linear
order in practice; FlashAttention 3's deterministic backward relies on the same), and each
program walks its query blocks from the last down, so it only waits on work its predecessor
does first. The Triton interpreter runs programs one by one with key blocks innermost: a
program's predecessors have always finished. Imports Triton at import time: import lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpdiag.kernels.attention_triton_common import LOG2E, AttnConfig, _last_dim_unit, _mm, _prec


@triton.jit
def _delta_kernel(O, DO, DELTA, L, BM: tl.constexpr, D: tl.constexpr):
    # delta = rowsum(O * dO) in fp32, one fixed order per row; O and dO are contiguous [B, H, L, D]
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rmask = offs_m < L
    io = bh * L * D + offs_m[:, None] * D + offs_d[None, :]
    o = tl.load(O + io, mask=rmask[:, None], other=0.0)
    do = tl.load(DO + io, mask=rmask[:, None], other=0.0)
    tl.store(DELTA + bh * L + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rmask)


@triton.jit
def _ordered_add(DQA, DQ, lock, part, io, rmask, n, last, sm_scale, EVEN: tl.constexpr):
    # this key block's dq partial, added after key blocks 0..n-1 and before n+1..last
    if n > 0:
        while tl.atomic_cas(lock, n, n, sem="acquire") != n:
            pass
        # .cg: read L2, where the predecessor's stores are, never a stale L1 line
        if EVEN:
            part += tl.load(DQA + io, cache_modifier=".cg")
        else:
            part += tl.load(DQA + io, mask=rmask[:, None], other=0.0, cache_modifier=".cg")
    if n == last:
        if EVEN:
            tl.store(DQ + io, (part * sm_scale).to(DQ.dtype.element_ty))
        else:
            tl.store(DQ + io, (part * sm_scale).to(DQ.dtype.element_ty), mask=rmask[:, None])
    else:
        if EVEN:
            tl.store(DQA + io, part)
        else:
            tl.store(DQA + io, part, mask=rmask[:, None])
        tl.debug_barrier()  # every thread's stores issued before the counter moves on
        tl.atomic_xchg(lock, n + 1, sem="release")


@triton.jit
def _step(dk, dv, k, v, offs_n, q_base, do_base, LSE, DELTA, DQA, DQ, lock_base, bh, sqm, start_m,
          pid_n, L, S, NBN, qk_scale, sm_scale, CAUSAL: tl.constexpr, DIAG: tl.constexpr,
          EVEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    rows = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rmask = rows < L
    if EVEN:
        q = tl.load(q_base + rows[:, None] * sqm + offs_d[None, :])
        do = tl.load(do_base + rows[:, None] * D + offs_d[None, :])
        lse = tl.load(LSE + bh * L + rows)
        delta = tl.load(DELTA + bh * L + rows)
    else:
        q = tl.load(q_base + rows[:, None] * sqm + offs_d[None, :], mask=rmask[:, None], other=0.0)
        do = tl.load(do_base + rows[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
        lse = tl.load(LSE + bh * L + rows, mask=rmask, other=0.0)
        delta = tl.load(DELTA + bh * L + rows, mask=rmask, other=0.0)
    st = _mm(k, tl.trans(q), PREC) * qk_scale  # [BN, BM]
    pt = tl.math.exp2(st - lse[None, :])
    if DIAG:
        pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
    if not EVEN:
        # padded keys too: their dS must be exactly 0, as they are in dq's sum
        pt = tl.where((rows[None, :] < L) & (offs_n[:, None] < S), pt, 0.0)
    dv += _mm(pt.to(do.dtype), do, PREC)
    dpt = _mm(v, tl.trans(do), PREC)
    dst = (pt * (dpt - delta[None, :])).to(q.dtype)
    dk += _mm(dst, q, PREC)
    part = _mm(tl.trans(dst), k, PREC)  # [BM, D]
    m = start_m // BM
    if CAUSAL:
        last = tl.minimum(NBN - 1, ((m + 1) * BM - 1) // BN)
    else:
        last = NBN - 1
    io = bh * L * D + rows[:, None] * D + offs_d[None, :]
    _ordered_add(DQA, DQ, lock_base + m, part, io, rmask, pid_n, last, sm_scale, EVEN)
    return dk, dv


@triton.jit
def _bwd_kernel(Q, K, V, DO, LSE, DELTA, DQA, DQ, DK, DV, LOCK, sqb, sqh, sqm, skb, skh, skn, svb, svh,
                svn, HK, REP, L, S, NBM, NBN, qk_scale, sm_scale,
                CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                PREC: tl.constexpr, EVEN: tl.constexpr):
    bhk = tl.program_id(0)  # fastest: key block n - 1 of a head launches before key block n
    pid_n = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    nmask = offs_n[:, None] < S
    k_ptr = K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :]
    v_ptr = V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :]
    if EVEN:
        k = tl.load(k_ptr)
        v = tl.load(v_ptr)
    else:
        k = tl.load(k_ptr, mask=nmask, other=0.0)
        v = tl.load(v_ptr, mask=nmask, other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    H = HK * REP
    for r in range(0, REP):  # this KV head's query heads, in head order
        h = hk * REP + r
        bh = b * H + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + bh * L * D  # dO is contiguous [B, H, L, D]
        lock_base = LOCK + bh * NBM
        # query blocks from the last down (see the module docstring)
        if CAUSAL:
            # rows [lo, mid) straddle the diagonal (BN is a multiple of BM); later rows see the
            # whole key block
            lo = tl.minimum(pid_n * BN, L)
            mid = tl.minimum((pid_n + 1) * BN, L)
            n_full = (L - mid + BM - 1) // BM
            for j in range(0, n_full):
                dk, dv = _step(dk, dv, k, v, offs_n, q_base, do_base, LSE, DELTA, DQA, DQ, lock_base, bh,
                               sqm, mid + (n_full - 1 - j) * BM, pid_n, L, S, NBN, qk_scale, sm_scale,
                               CAUSAL, False, EVEN, BM, BN, D, PREC)
            n_diag = (mid - lo + BM - 1) // BM
            for j in range(0, n_diag):
                dk, dv = _step(dk, dv, k, v, offs_n, q_base, do_base, LSE, DELTA, DQA, DQ, lock_base, bh,
                               sqm, lo + (n_diag - 1 - j) * BM, pid_n, L, S, NBN, qk_scale, sm_scale,
                               CAUSAL, True, EVEN, BM, BN, D, PREC)
        else:
            n_all = (L + BM - 1) // BM
            for j in range(0, n_all):
                dk, dv = _step(dk, dv, k, v, offs_n, q_base, do_base, LSE, DELTA, DQA, DQ, lock_base, bh,
                               sqm, (n_all - 1 - j) * BM, pid_n, L, S, NBN, qk_scale, sm_scale,
                               CAUSAL, False, EVEN, BM, BN, D, PREC)
    out = bhk * S * D + offs_n[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty))
        tl.store(DV + out, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=nmask)


def backward(do, q, k, v, o, lse, causal: bool, scale: float, cfg: AttnConfig):
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    do, o = do.contiguous(), o.contiguous()
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    BM, BN = cfg.kv_m, cfg.kv_n
    NBM, NBN = triton.cdiv(L, BM), triton.cdiv(S, BN)
    dev = q.device
    delta = torch.empty(B * H, L, dtype=torch.float32, device=dev)
    _delta_kernel[(triton.cdiv(L, cfg.q_m), B * H)](o, do, delta, L, BM=cfg.q_m, D=D, num_warps=cfg.q_warps)
    dq_acc = torch.empty(B * H * L * D, dtype=torch.float32, device=dev)  # key block 0 stores first
    lock = torch.zeros(B * H * NBM, dtype=torch.int32, device=dev)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=dev)
    dk = torch.empty(B, Hk, S, D, dtype=k.dtype, device=dev)
    dv = torch.empty(B, Hk, S, D, dtype=v.dtype, device=dev)
    if L == 0 or S == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _bwd_kernel[(B * Hk, NBN)](
        q, k, v, do, lse, delta, dq_acc, dq, dk, dv, lock,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), Hk, H // Hk, L, S, NBM, NBN, scale * LOG2E, scale,
        CAUSAL=causal, BM=BM, BN=BN, D=D, PREC=_prec(q), EVEN=L % BM == 0 and S % BN == 0,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    return dq, dk, dv
