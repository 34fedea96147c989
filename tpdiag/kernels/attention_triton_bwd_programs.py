"""The backward's programs (attention_triton_bwd.py launches them): one dk/dv program, one dq
recompute program - each a function of its program id, so one launch may hold both - and the
kernels that combine them, both deterministic and invariant as the two main paths are:

- one launch (AttnConfig.bwd_fused): after delta's small pass, a grid whose first programs are the
  recompute path's dk/dv programs and the rest its dq programs - the same programs, each summing
  in the same order; only when each runs moves.
- shared work (AttnConfig.ds_every = K > 1, with ds_mib): the dk/dv pass stores the dS of every
  K-th key block only, and dq reads those back and recomputes the rest - the same bf16 dS into
  the same products in the same order, for 1/K of the dS traffic and (K-1)/K of the recompute.
  Which blocks are kept depends on the key-block index only: every TP degree and batch the same.

Imports Triton at import time: import this module lazily.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tpdiag.kernels.attention_triton import _block_and_head, _block_and_head_at, _load_rows, _mm, _tile
from tpdiag.kernels.exp2_soft import exp2_mixed


@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm, lo, hi, L, S,
                qk_scale, DS, ds_idx, n0, keep, DIAG: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, STORE_DS: tl.constexpr,
                LOADS: tl.constexpr, I64: tl.constexpr, SOFT: tl.constexpr, DEG: tl.constexpr):
    # STORE_DS: 0 no dS, 1 dS by plain stores, 2 by TMA (DS a [heads, S, L] descriptor: the
    # store leaves from shared memory while the next block's products run); `keep`: whether this
    # key block's dS is stored (AttnConfig.ds_every). LOADS: q_src and do_src are [B, H, L, D]
    # descriptors (rows past L read as 0), else this head's base pointers
    offs_m0 = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        rows = start_m + offs_m0
        q = _tile(q_src, b, h, start_m, rows, sqm, offs_d, L, BM, D, EVEN, I64, LOADS)
        do = _tile(do_src, b, h, start_m, rows, D, offs_d, L, BM, D, EVEN, I64, LOADS)
        if EVEN:
            lse = tl.load(LSE + row_base + rows)
            delta = tl.load(DELTA + row_base + rows)
        else:
            lse = tl.load(LSE + row_base + rows, mask=rows < L, other=0.0)
            delta = tl.load(DELTA + row_base + rows, mask=rows < L, other=0.0)
        st = _mm(k, tl.trans(q), PREC) * qk_scale  # [BN, BM]
        pt = exp2_mixed(st - lse[None, :], BN, BM, SOFT, DEG)  # AttnConfig.exp_soft: by query column
        if DIAG:
            pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
        if not EVEN:
            pt = tl.where(rows[None, :] < L, pt, 0.0)
        dv += _mm(pt.to(do.dtype), do, PREC)
        dpt = _mm(v, tl.trans(do), PREC)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        if STORE_DS == 2:
            if keep:
                DS.store([ds_idx, n0, start_m], tl.reshape(dst, [1, BN, BM]))
        elif STORE_DS == 1:
            if keep:
                # dS^T of this head, [S, L]: rows of keys, contiguous over query rows
                ds_ptr = DS + ds_idx.to(tl.int64) * S * L + offs_n[:, None].to(tl.int64) * L + rows[None, :]
                if EVEN:
                    tl.store(ds_ptr, dst)
                else:
                    tl.store(ds_ptr, dst, mask=(offs_n[:, None] < S) & (rows[None, :] < L))
        dk += _mm(dst, q, PREC)
    return dk, dv


@triton.jit
def _dkdv_inner_split(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm, lo, hi, L, S,
                      qk_scale, DIAG: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr, PREC: tl.constexpr, LOADS: tl.constexpr, I64: tl.constexpr):
    # _dkdv_inner (no dS store, exp2 only) with each BM-row step taken as two halves whose products
    # interleave - both halves' S^T products issued before the first half's exp2, the first
    # half's dP^T and dV products before the second's exp2 - so the exp2 and the dS arithmetic of
    # one half can run beside the other's tensor-core products (FlashAttention-3's intra-warpgroup
    # overlap; AttnConfig.kv_split). dV and dK take the halves in row order: the k16 chunks of a
    # BM-row product in the same order into the same fp32 accumulator. LOADS: descriptors of
    # BM // 2-row blocks
    HM: tl.constexpr = BM // 2
    offs_h = tl.arange(0, HM)
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        ra = start_m + offs_h
        rb = ra + HM
        qa = _tile(q_src, b, h, start_m, ra, sqm, offs_d, L, HM, D, EVEN, I64, LOADS)
        qb = _tile(q_src, b, h, start_m + HM, rb, sqm, offs_d, L, HM, D, EVEN, I64, LOADS)
        doa = _tile(do_src, b, h, start_m, ra, D, offs_d, L, HM, D, EVEN, I64, LOADS)
        dob = _tile(do_src, b, h, start_m + HM, rb, D, offs_d, L, HM, D, EVEN, I64, LOADS)
        if EVEN:
            lsea = tl.load(LSE + row_base + ra)
            lseb = tl.load(LSE + row_base + rb)
            dla = tl.load(DELTA + row_base + ra)
            dlb = tl.load(DELTA + row_base + rb)
        else:
            lsea = tl.load(LSE + row_base + ra, mask=ra < L, other=0.0)
            lseb = tl.load(LSE + row_base + rb, mask=rb < L, other=0.0)
            dla = tl.load(DELTA + row_base + ra, mask=ra < L, other=0.0)
            dlb = tl.load(DELTA + row_base + rb, mask=rb < L, other=0.0)
        sta = _mm(k, tl.trans(qa), PREC) * qk_scale  # [BN, HM]
        stb = _mm(k, tl.trans(qb), PREC) * qk_scale
        pta = tl.math.exp2(sta - lsea[None, :])
        if DIAG:
            pta = tl.where(ra[None, :] >= offs_n[:, None], pta, 0.0)
        if not EVEN:
            pta = tl.where(ra[None, :] < L, pta, 0.0)
        dpta = _mm(v, tl.trans(doa), PREC)
        dv += _mm(pta.to(doa.dtype), doa, PREC)
        ptb = tl.math.exp2(stb - lseb[None, :])
        if DIAG:
            ptb = tl.where(rb[None, :] >= offs_n[:, None], ptb, 0.0)
        if not EVEN:
            ptb = tl.where(rb[None, :] < L, ptb, 0.0)
        dptb = _mm(v, tl.trans(dob), PREC)
        dv += _mm(ptb.to(dob.dtype), dob, PREC)
        dsa = (pta * (dpta - dla[None, :])).to(qa.dtype)
        dk += _mm(dsa, qa, PREC)
        dsb = (ptb * (dptb - dlb[None, :])).to(qb.dtype)
        dk += _mm(dsb, qb, PREC)
    return dk, dv


@triton.jit
def _dkdv_program(pid, Q, K, V, DO, LSE, DELTA, DK, DV, DS, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                  HK, REP, L, S, qk_scale, sm_scale, NB, BH, G, BH0,
                  CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                  PREC: tl.constexpr, EVEN: tl.constexpr, STORE_DS: tl.constexpr, LOADS: tl.constexpr,
                  I64: tl.constexpr, DS_EVERY: tl.constexpr, SOFT: tl.constexpr, DEG: tl.constexpr,
                  SPLIT: tl.constexpr = False):
    # program `pid` of the dk/dv pass; BH0: the first (batch, KV head) of this launch (a chunk of
    # heads whose dS fits DS); DS_EVERY > 1: dS of every DS_EVERY-th key block only; SPLIT: the
    # loops by _dkdv_inner_split (no dS store, exp2 only: the caller checks)
    pid_n, bhl = _block_and_head_at(pid, NB, BH, G)
    pid_n = NB - 1 - pid_n  # key block 0 sees every query row: the most work
    keep = True
    if DS_EVERY > 1:
        keep = pid_n % DS_EVERY == 0
    bhk = BH0 + bhl
    b = bhk // HK
    hk = bhk % HK
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    nmask = offs_n[:, None] < S
    k = _load_rows(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh, offs_n, skn, offs_d, S, EVEN, I64)
    v = _load_rows(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh, offs_n, svn, offs_d, S, EVEN, I64)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    H = HK * REP
    for r in range(0, REP):  # this KV head's query heads, in head order
        h = hk * REP + r
        if LOADS:
            q_src = Q
            do_src = DO
        else:
            q_src = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_src = DO + (b * H + h).to(tl.int64) * L * D  # dO is contiguous [B, H, L, D]
        row_base = (b * H + h).to(tl.int64) * L
        ds_idx = bhl * REP + r  # this query head in the launch's dS scratch
        if SPLIT:
            if CAUSAL:
                lo = tl.minimum(n0, L)
                mid = tl.minimum(n0 + BN, L)
                dk, dv = _dkdv_inner_split(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm,
                                           lo, mid, L, S, qk_scale, True, EVEN, BM, BN, D, PREC, LOADS, I64)
                dk, dv = _dkdv_inner_split(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm,
                                           mid, L, L, S, qk_scale, False, EVEN, BM, BN, D, PREC, LOADS, I64)
            else:
                dk, dv = _dkdv_inner_split(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm,
                                           0, L, L, S, qk_scale, False, EVEN, BM, BN, D, PREC, LOADS, I64)
        elif CAUSAL:
            # query rows [n0, n0 + BN) straddle the diagonal (BN is a multiple of BM); later
            # rows see the whole key block
            lo = tl.minimum(n0, L)
            mid = tl.minimum(n0 + BN, L)
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm,
                                 lo, mid, L, S, qk_scale, DS, ds_idx, n0, keep, True, EVEN, BM, BN, D, PREC,
                                 STORE_DS, LOADS, I64, SOFT, DEG)
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm,
                                 mid, L, L, S, qk_scale, DS, ds_idx, n0, keep, False, EVEN, BM, BN, D, PREC,
                                 STORE_DS, LOADS, I64, SOFT, DEG)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, LSE, DELTA, row_base, sqm,
                                 0, L, L, S, qk_scale, DS, ds_idx, n0, keep, False, EVEN, BM, BN, D, PREC,
                                 STORE_DS, LOADS, I64, SOFT, DEG)
    # the head's base in int64, the offsets within it in int32 (pointer first: no int64 tiles)
    hb = bhk.to(tl.int64) * S * D
    out = offs_n[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(DK + hb + out, (dk * sm_scale).to(DK.dtype.element_ty))
        tl.store(DV + hb + out, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + hb + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask)
        tl.store(DV + hb + out, dv.to(DV.dtype.element_ty), mask=nmask)


@triton.jit
def _do_and_delta(O, DO, io, rmask, EVEN: tl.constexpr):
    """(dO rows, delta = rowsum(O * dO) in fp32, one fixed order per row) at offsets io."""
    if EVEN:
        do = tl.load(DO + io)
        o = tl.load(O + io)
    else:
        do = tl.load(DO + io, mask=rmask[:, None], other=0.0)
        o = tl.load(O + io, mask=rmask[:, None], other=0.0)
    return do, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, lo, hi, S, qk_scale,
              DIAG: tl.constexpr, EVEN: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
              PREC: tl.constexpr, I64: tl.constexpr, BM: tl.constexpr, SOFT: tl.constexpr, DEG: tl.constexpr,
              LOADS: tl.constexpr):
    # LOADS: k_src / v_src are [B, Hk, S, D] descriptors (rows past S read as 0), else this KV
    # head's base pointers
    offs_n0 = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n0
        k = _tile(k_src, b, hk, start_n, cols, skn, offs_d, S, BN, D, EVEN, I64, LOADS)
        v = _tile(v_src, b, hk, start_n, cols, svn, offs_d, S, BN, D, EVEN, I64, LOADS)
        s = _mm(q, tl.trans(k), PREC) * qk_scale
        p = exp2_mixed(s - lse[:, None], BM, BN, SOFT, DEG)  # AttnConfig.exp_soft: by key column
        if DIAG:
            p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
        if not EVEN:
            p = tl.where(cols[None, :] < S, p, 0.0)
        dp = _mm(do, tl.trans(v), PREC)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds.to(k.dtype), k, PREC)
    return dq


@triton.jit
def _dq_program(pid, Q, K, V, O, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                H, REP, L, S, qk_scale, sm_scale, NB, BH, G,
                CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                PREC: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr, STORE_DELTA: tl.constexpr,
                SOFT: tl.constexpr, DEG: tl.constexpr, LOADS: tl.constexpr = False):
    # program `pid` of the dq recompute pass; STORE_DELTA: this pass writes delta for the dk/dv
    # pass after it (else a delta pass did, and the dk/dv programs may be reading it now);
    # LOADS: K and V are [B, Hk, S, D] descriptors (AttnConfig.dq_tma)
    pid_m, bh = _block_and_head_at(pid, NB, BH, G)
    b = bh // H
    h = bh % H
    hk = h // REP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rmask = offs_m < L
    hb = bh.to(tl.int64) * L * D
    io = offs_m[:, None] * D + offs_d[None, :]
    # O and dO are contiguous [B, H, L, D]; this pass runs first and writes delta =
    # rowsum(O * dO) (fp32, one fixed order per row) for the dk/dv pass
    q = _load_rows(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh, offs_m, sqm, offs_d, L, EVEN, I64)
    do, delta = _do_and_delta(O + hb, DO + hb, io, rmask, EVEN)
    if STORE_DELTA:
        tl.store(DELTA + bh.to(tl.int64) * L + offs_m, delta, mask=rmask)
    if EVEN:
        lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m)
    else:
        lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=rmask, other=0.0)
    if LOADS:
        k_src = K
        v_src = V
    else:
        k_src = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_src = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        diag = tl.minimum(pid_m * BM, S)  # BM is a multiple of BN
        dq = _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, 0, diag, S, qk_scale,
                       False, EVEN, BN, D, PREC, I64, BM, SOFT, DEG, LOADS)
        dq = _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, diag,
                       tl.minimum((pid_m + 1) * BM, S), S, qk_scale, True, EVEN, BN, D, PREC, I64, BM, SOFT, DEG,
                       LOADS)
    else:
        dq = _dq_inner(dq, q, do, lse, delta, k_src, v_src, b, hk, skn, svn, offs_m, 0, S, S, qk_scale,
                       False, EVEN, BN, D, PREC, I64, BM, SOFT, DEG, LOADS)
    if EVEN:
        tl.store(DQ + hb + io, (dq * sm_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(DQ + hb + io, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rmask[:, None])


@triton.jit(do_not_specialize=["NK", "BHK", "GK", "NQ", "BH", "GQ"])  # one compile for any launch order
def _fused_kernel(Q, QD, K, V, O, DO, DOD, LSE, DELTA, DQ, DK, DV, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                  HK, REP, L, S, qk_scale, sm_scale, NK, BHK, GK, NQ, BH, GQ,
                  CAUSAL: tl.constexpr, KV_M: tl.constexpr, KV_N: tl.constexpr, Q_M: tl.constexpr,
                  Q_N: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, EVEN_KV: tl.constexpr,
                  EVEN_Q: tl.constexpr, LOADS: tl.constexpr, I64: tl.constexpr, SOFT_KV: tl.constexpr = 0,
                  SOFT_Q: tl.constexpr = 0, DEG: tl.constexpr = 3):
    # the recompute backward's two passes in one grid (AttnConfig.bwd_fused): programs
    # [0, NK * BHK) are the dk/dv pass's, the rest the dq pass's; delta is already in DELTA.
    # QD / DOD: q and dO as the dk/dv loops load them (descriptors where LOADS)
    pid = tl.program_id(0)
    if pid < NK * BHK:
        _dkdv_program(pid, QD, K, V, DOD, LSE, DELTA, DK, DV, DK, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                      HK, REP, L, S, qk_scale, sm_scale, NK, BHK, GK, 0, CAUSAL, KV_M, KV_N, D, PREC, EVEN_KV, 0,
                      LOADS, I64, 1, SOFT_KV, DEG)
    else:
        _dq_program(pid - NK * BHK, Q, K, V, O, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                    HK * REP, REP, L, S, qk_scale, sm_scale, NQ, BH, GQ, CAUSAL, Q_M, Q_N, D, PREC, EVEN_Q, I64,
                    False, SOFT_Q, DEG, False)


@triton.jit
def _dq_mix_inner(dq, q, do, lse, delta, DS, ds_idx, k_base, v_base, skn, svn, offs_m, lo, hi, L, S, qk_scale,
                  DIAG: tl.constexpr, EVEN: tl.constexpr, BN: tl.constexpr, KV_N: tl.constexpr,
                  EVERY: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, I64: tl.constexpr):
    # key blocks lo, lo + BN, ... < hi in ascending order; a block whose dk/dv key block (KV_N
    # keys) stored its dS reads it back, the others recompute it as _dq_inner does - the same
    # bf16 dS either way, into the same product in the same order
    offs_n0 = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n0
        k = _load_rows(k_base, cols, skn, offs_d, S, EVEN, I64)
        if (start_n // KV_N) % EVERY == 0:
            ptrs = DS + ds_idx.to(tl.int64) * S * L + cols[:, None].to(tl.int64) * L + offs_m[None, :]
            if EVEN:
                dst = tl.load(ptrs)
            else:
                dst = tl.load(ptrs, mask=(cols[:, None] < S) & (offs_m[None, :] < L), other=0.0)
            if DIAG:  # nothing kept above the diagonal: whatever is there reads as 0
                dst = tl.where(offs_m[None, :] >= cols[:, None], dst, 0.0)
            ds = tl.trans(dst)
        else:
            v = _load_rows(v_base, cols, svn, offs_d, S, EVEN, I64)
            s = _mm(q, tl.trans(k), PREC) * qk_scale
            p = tl.math.exp2(s - lse[:, None])
            if DIAG:
                p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
            if not EVEN:
                p = tl.where(cols[None, :] < S, p, 0.0)
            dp = _mm(do, tl.trans(v), PREC)
            ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq += _mm(ds, k, PREC)
    return dq


@triton.jit(do_not_specialize=["NB", "BH", "G", "BH0"])  # one compile for any launch order
def _dq_mix_kernel(DS, Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                   H, REP, L, S, qk_scale, sm_scale, NB, BH, G, BH0,
                   CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KV_N: tl.constexpr,
                   EVERY: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr,
                   I64: tl.constexpr):
    # dq of row block pid_m from stored dS where the dk/dv pass kept it (AttnConfig.ds_every),
    # recomputed elsewhere; dO contiguous [B, H, L, D]; delta from the delta pass
    pid_m, bhl = _block_and_head(NB, BH, G)
    bh = BH0 + bhl
    b = bh // H
    h = bh % H
    hk = h // REP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = _load_rows(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh, offs_m, sqm, offs_d, L, EVEN, I64)
    do = _load_rows(DO + bh.to(tl.int64) * L * D, offs_m, D, offs_d, L, EVEN, I64)
    if EVEN:
        lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m)
        delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m)
    else:
        lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=0.0)
        delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=0.0)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        diag = tl.minimum(m0, S)  # BM is a multiple of BN
        dq = _dq_mix_inner(dq, q, do, lse, delta, DS, bhl, k_base, v_base, skn, svn, offs_m, 0, diag, L, S,
                           qk_scale, False, EVEN, BN, KV_N, EVERY, D, PREC, I64)
        dq = _dq_mix_inner(dq, q, do, lse, delta, DS, bhl, k_base, v_base, skn, svn, offs_m, diag,
                           tl.minimum(m0 + BM, S), L, S, qk_scale, True, EVEN, BN, KV_N, EVERY, D, PREC, I64)
    else:
        dq = _dq_mix_inner(dq, q, do, lse, delta, DS, bhl, k_base, v_base, skn, svn, offs_m, 0, S, L, S,
                           qk_scale, False, EVEN, BN, KV_N, EVERY, D, PREC, I64)
    dq_ptr = DQ + bh.to(tl.int64) * L * D + offs_m[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < L)


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
