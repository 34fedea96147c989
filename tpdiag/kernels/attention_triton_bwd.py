"""The deterministic backward of invariant attention: two passes, no atomics.

No atomics and no ordering between programs: one dk/dv program per (batch, KV head, key block)
loops over its query heads in head order and over the query blocks in a fixed order; a separate
dq program per (batch, query head, row block) loops over the key blocks in a fixed order and
recomputes P for it - 7 block products per (query, key) block pair where an atomic dq needs 5.
A one-pass backward that added the dq partials in key-block order behind a per-query-block
counter (commit eefece6) was bitwise and reproducible on an H200 but 2.4x slower (9.6 vs 4.1 ms
at B8 S4096 H32 D64 bf16; docs/benchmarks.md): the ordered add's wait, L2 read and release fence
sit on every step's critical path, where the recompute is only more of the dots that run fast.
Imports Triton at import time: import this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpdiag.kernels.attention_triton_common import (LOG2E, AttnConfig, _last_dim_unit, _load_rows, _mm, _prec,
                                                     descriptors, tma_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, QSCALE, DQI, row_base, sqm, lo,
                hi, L, qk_scale, DIAG: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr,
                D: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, DQ_FIXED: tl.constexpr):
    offs_m0 = tl.arange(0, BM)
    for start_m in range(lo, hi, BM):
        rows = start_m + offs_m0
        q = _load_rows(q_src, b, h, start_m, sqm, L, BM, D, EVEN, TMA)
        do = _load_rows(do_src, b, h, start_m, D, L, BM, D, EVEN, TMA)
        if EVEN:
            lse = tl.load(LSE + row_base + rows)
            delta = tl.load(DELTA + row_base + rows)
        else:
            rmask = rows < L
            lse = tl.load(LSE + row_base + rows, mask=rmask, other=0.0)
            delta = tl.load(DELTA + row_base + rows, mask=rmask, other=0.0)
        st = _mm(k, tl.trans(q), PREC) * qk_scale  # [BN, BM]
        pt = tl.math.exp2(st - lse[None, :])
        if DIAG:
            pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
        if not EVEN:
            pt = tl.where(rows[None, :] < L, pt, 0.0)
        dv += _mm(pt.to(do.dtype), do, PREC)
        dpt = _mm(v, tl.trans(do), PREC)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk += _mm(dst, q, PREC)
        if DQ_FIXED:
            # this key block's dq partial as an integer multiple of 2^-s (s per row, from a
            # bound on |dq|): integer adds are associative, so the atomics' arrival order
            # cannot change the sum's bits
            part = _mm(tl.trans(dst), k, PREC)  # [BM, D]
            if EVEN:
                qs = tl.load(QSCALE + row_base + rows)
            else:
                qs = tl.load(QSCALE + row_base + rows, mask=rows < L, other=0.0)
            fixed = (part * qs[:, None]).to(tl.int64)
            ptr = DQI + (row_base + rows)[:, None] * D + tl.arange(0, D)[None, :]
            if EVEN:
                tl.atomic_add(ptr, fixed, sem="relaxed")
            else:
                tl.atomic_add(ptr, fixed, mask=(rows < L)[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, QSCALE, DQI, DK, DV, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                 HK, REP, L, S, qk_scale, sm_scale,
                 CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 PREC: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, DQ_FIXED: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
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
        if TMA:
            q_src = Q
            do_src = DO
        else:
            q_src = Q + b * sqb + h * sqh
            do_src = DO + (b * H + h) * L * D  # dO is contiguous [B, H, L, D]
        row_base = (b * H + h) * L
        if CAUSAL:
            # query rows [n0, n0 + BN) straddle the diagonal (BN is a multiple of BM); later
            # rows see the whole key block
            lo = tl.minimum(pid_n * BN, L)
            mid = tl.minimum((pid_n + 1) * BN, L)
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, QSCALE, DQI, row_base, sqm,
                                 lo, mid, L, qk_scale, True, EVEN, BM, D, PREC, TMA, DQ_FIXED)
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, QSCALE, DQI, row_base, sqm,
                                 mid, L, L, qk_scale, False, EVEN, BM, D, PREC, TMA, DQ_FIXED)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, QSCALE, DQI, row_base, sqm,
                                 0, L, L, qk_scale, False, EVEN, BM, D, PREC, TMA, DQ_FIXED)
    out = bhk * S * D + offs_n[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty))
        tl.store(DV + out, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=nmask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, lo, hi, S, qk_scale,
              DIAG: tl.constexpr, EVEN: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
              PREC: tl.constexpr, TMA: tl.constexpr):
    offs_n0 = tl.arange(0, BN)
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n0
        k = _load_rows(k_src, b, hk, start_n, skn, S, BN, D, EVEN, TMA)
        v = _load_rows(v_src, b, hk, start_n, svn, S, BN, D, EVEN, TMA)
        s = _mm(q, tl.trans(k), PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if DIAG:
            p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
        if not EVEN:
            p = tl.where(cols[None, :] < S, p, 0.0)
        dp = _mm(do, tl.trans(v), PREC)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds.to(k.dtype), k, PREC)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
               H, REP, L, S, qk_scale, sm_scale,
               CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               PREC: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // REP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rmask = offs_m < L
    q_ptr = Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :]
    io = bh * L * D + offs_m[:, None] * D + offs_d[None, :]
    # O and dO are contiguous [B, H, L, D]; this pass runs first and writes delta =
    # rowsum(O * dO) (fp32, one fixed order per row) for the dk/dv pass
    if EVEN:
        q = tl.load(q_ptr)
        do = tl.load(DO + io)
        o = tl.load(O + io)
        lse = tl.load(LSE + bh * L + offs_m)
    else:
        q = tl.load(q_ptr, mask=rmask[:, None], other=0.0)
        do = tl.load(DO + io, mask=rmask[:, None], other=0.0)
        o = tl.load(O + io, mask=rmask[:, None], other=0.0)
        lse = tl.load(LSE + bh * L + offs_m, mask=rmask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * L + offs_m, delta, mask=rmask)
    if TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b * skb + hk * skh
        v_src = V + b * svb + hk * svh
    dq = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        diag = tl.minimum(pid_m * BM, S)  # BM is a multiple of BN
        dq = _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, 0, diag, S, qk_scale,
                       False, EVEN, BN, D, PREC, TMA)
        dq = _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, diag,
                       tl.minimum((pid_m + 1) * BM, S), S, qk_scale, True, EVEN, BN, D, PREC, TMA)
    else:
        dq = _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, 0, S, S, qk_scale,
                       False, EVEN, BN, D, PREC, TMA)
    if EVEN:
        tl.store(DQ + io, (dq * sm_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(DQ + io, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _prep_kernel(O, DO, KV, DELTA, QSCALE, L, H, REP, BM: tl.constexpr, D: tl.constexpr):
    """delta = rowsum(O * dO) (fp32, one fixed order per row), and per row the power of two
    2^s that puts the row's dq on the int64 grid: |dq_i| <= B_i = 2 D max|dO_i| max|V| max|K|
    (|dP_ij| and |delta_i| are both <= D max|dO_i| max|V|, the softmax row sums to 1), so with
    2^e >= 2 B_i and s = 62 - e every partial sum of the row fits in 2^61. Exact maxima and a
    power of two: the same s for a row at any TP degree or batch size."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    rmask = offs_m < L
    io = bh * L * D + offs_m[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(O + io, mask=rmask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + io, mask=rmask[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + bh * L + offs_m, tl.sum(o * do, 1), mask=rmask)
    kv = tl.load(KV + (bh // (H * REP)) * H + (bh % (H * REP)) // REP)  # max|K| max|V| of the KV head
    bound = 2.0 * D * tl.max(tl.abs(do), 1) * kv
    e = ((bound.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 2  # floor(log2) + 2
    e = tl.minimum(tl.maximum(e, -60), 126)
    qs = ((62 - e + 127) << 23).to(tl.float32, bitcast=True)
    # a non-finite bound (inf/NaN inputs): dq becomes NaN, as a float sum would
    qs = tl.where(bound == bound and bound < float("inf"), qs, float("nan"))
    tl.store(QSCALE + bh * L + offs_m, qs, mask=rmask)


@triton.jit
def _dq_final_kernel(DQI, QSCALE, DQ, L, sm_scale, BM: tl.constexpr, D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    rmask = offs_m < L
    io = bh * L * D + offs_m[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.load(DQI + io, mask=rmask[:, None], other=0)
    qs = tl.load(QSCALE + bh * L + offs_m, mask=rmask, other=1.0)
    dq = acc.to(tl.float64) / qs.to(tl.float64)[:, None] * sm_scale
    tl.store(DQ + io, dq.to(tl.float32).to(DQ.dtype.element_ty), mask=rmask[:, None])


def _backward_fixed(do, q, k, v, o, lse, causal, scale, cfg, strides, dk, dv):
    """One pass: dq through int64 atomics on a per-row fixed-point grid (5 block products per
    pair, and no order to keep)."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    dev = q.device
    # exact maxima (no rounding in a max), their product rounded once in fp32: the bound keeps
    # a factor 2 of margin for that and for the kernel's own rounding of P and dS
    kv = (k.abs().amax((2, 3)).float() * v.abs().amax((2, 3)).float()).contiguous()
    delta = torch.empty(B * H, L, dtype=torch.float32, device=dev)
    qscale = torch.empty(B * H, L, dtype=torch.float32, device=dev)
    grid_rows = (triton.cdiv(L, cfg.q_m), B * H)
    _prep_kernel[grid_rows](o, do, kv, delta, qscale, L, Hk, H // Hk, BM=cfg.q_m, D=D, num_warps=cfg.q_warps)
    dqi = torch.zeros(B * H * L * D, dtype=torch.int64, device=dev)
    tma = tma_ok(cfg, q, k, v, do)
    qd, dod = descriptors(tma, cfg.kv_m, q, do)
    _dkdv_kernel[(triton.cdiv(S, cfg.kv_n), B * Hk)](
        qd, k, v, dod, lse, delta, qscale, dqi, dk, dv, *strides, Hk, H // Hk, L, S, scale * LOG2E, scale,
        CAUSAL=causal, BM=cfg.kv_m, BN=cfg.kv_n, D=D, PREC=_prec(q),
        EVEN=L % cfg.kv_m == 0 and S % cfg.kv_n == 0, TMA=tma, DQ_FIXED=True,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=dev)
    _dq_final_kernel[grid_rows](dqi, qscale, dq, L, scale, BM=cfg.q_m, D=D, num_warps=cfg.q_warps)
    return dq


def backward(do, q, k, v, o, lse, causal: bool, scale: float, cfg: AttnConfig):
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    do = do.contiguous()
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    delta = torch.empty(B * H, L, dtype=torch.float32, device=q.device)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hk, S, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hk, S, D, dtype=v.dtype, device=q.device)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    if cfg.dq_fixed:
        return _backward_fixed(do, q, k, v, o, lse, causal, scale, cfg, strides, dk, dv), dk, dv
    # dq first: it also writes delta, which the dk/dv pass reads
    tma = tma_ok(cfg, q, k, v, do)
    kd, vd = descriptors(tma, cfg.q_n, k, v)
    _dq_kernel[(triton.cdiv(L, cfg.q_m), B * H)](
        q, kd, vd, o, do, lse, delta, dq, *strides, H, H // Hk, L, S, scale * LOG2E, scale,
        CAUSAL=causal, BM=cfg.q_m, BN=cfg.q_n, D=D, PREC=_prec(q),
        EVEN=L % cfg.q_m == 0 and S % cfg.q_n == 0, TMA=tma,
        num_warps=cfg.q_warps, num_stages=cfg.q_stages)
    qd, dod = descriptors(tma, cfg.kv_m, q, do)
    _dkdv_kernel[(triton.cdiv(S, cfg.kv_n), B * Hk)](
        qd, k, v, dod, lse, delta, delta, delta, dk, dv, *strides, Hk, H // Hk, L, S, scale * LOG2E, scale,
        CAUSAL=causal, BM=cfg.kv_m, BN=cfg.kv_n, D=D, PREC=_prec(q),
        EVEN=L % cfg.kv_m == 0 and S % cfg.kv_n == 0, TMA=tma, DQ_FIXED=False,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    return dq, dk, dv
