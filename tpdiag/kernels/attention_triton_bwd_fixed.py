"""The one-pass backward of invariant attention with dq on a fixed-point grid (AttnConfig.dq_fixed):
the dk/dv programs also form each block pair's dq partial dS @ K (5 block products a pair, as an
atomic dq does, against the recompute's 7) and add it, scaled to integers, into an int64 (or
int32) accumulator by atomics. Integer addition is associative and commutative (modulo 2^bits, so
even a wrapped partial sum comes back): the order in which the programs' adds land moves no bit,
so the result is deterministic, and TP/batch invariant because each row's scale is a function of
that row's dO and its KV head's K and V alone.

The scale: |dq_i| <= max|K| sum_j |dS_ij|, dS_ij = P_ij (dP_ij - delta_i), |dP_ij| and |delta_i|
<= ||dO_i||_1 max|V| (O is a convex combination of V's rows), and sum_j P_ij = 1: so
|dq_i| <= 2 ||dO_i||_1 max|V| max|K|. The prep pass takes bound_i = 4 ||dO_i||_1 max|V| max|K| (a
factor 2 for the roundings: P's sum past 1 by lse's rounding, dS rounded to the input dtype, the
fp32 sums) and the power of two 2^s with 2^(s + e) = 2^(bits - 2), 2^e > bound_i: every partial
and the final sum of the row sit under 2^(bits - 3) on the grid, the truncation of each partial
costs under one grid step (2^-s: at most 2^(3 - bits) of the bound). A non-finite bound gives the
row NaN. Then one pass converts: acc (rounded to fp32 once) * 2^-s * scale, to the output dtype.

Slower than the recompute at D=64 on an H200 (backward 4.6 ms int32, 6.0 int64, against 4.0):
staging each step's dq tile through shared memory and the 5th product cost more than the dq
pass they replace (docs/benchmarks.md, "Invariant attention"). Off by default.

The adds: TMA bulk reductions of a [BM, D] tile (RED = 2: Hopper+, Triton's descriptor
atomic_add, uint64 / int32) or per-element atomics (RED = 1: the interpreter, and where
descriptors cannot be used). Imports Triton at import time: import this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpdiag.kernels.attention_triton import (LOG2E, _block_and_head, _block_and_head_at, _load_rows, _mm, _prec,
                                             _tile, desc, tma_ok, wide)
from tpdiag.kernels.attention_triton_bwd_programs import _do_and_delta

BULK = True  # the adds by TMA bulk reductions where the chip has them (False: per-element atomics)


@triton.jit(do_not_specialize=["NB", "BH"])
def _prep_kernel(O, DO, KV, DELTA, QS, L, REP, NB, BH, BM: tl.constexpr, D: tl.constexpr, EVEN: tl.constexpr,
                 BITS: tl.constexpr):
    # delta = rowsum(O * dO) (the recompute path's own sum), and per row the grid's power of two
    # 2^s (QS[0]) and its inverse 2^-s (QS[1]); KV: max|K| * max|V| per (batch, KV head)
    pid_m, bh = _block_and_head(NB, BH, 1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    rmask = offs_m < L
    hb = bh.to(tl.int64) * L * D
    io = offs_m[:, None] * D + tl.arange(0, D)[None, :]
    do, delta = _do_and_delta(O + hb, DO + hb, io, rmask, EVEN)
    tl.store(DELTA + bh.to(tl.int64) * L + offs_m, delta, mask=rmask)
    kv = tl.load(KV + bh // REP)  # (b * H + h) // REP = b * Hk + h // REP
    bound = 4.0 * tl.sum(tl.abs(do.to(tl.float32)), 1) * kv
    # 2^e > bound: e = floor(log2(bound)) + 1 from the exponent field (a subnormal or 0 bound
    # reads as 2^-126, still above it)
    e = ((bound.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    s = tl.minimum(tl.maximum(BITS - 2 - e, -126), 126)  # both 2^s and 2^-s normal fp32
    fin = (bound == bound) & (bound < float("inf"))
    qs = tl.where(fin, ((s + 127) << 23).to(tl.float32, bitcast=True), float("nan"))
    inv = tl.where(fin, ((127 - s) << 23).to(tl.float32, bitcast=True), float("nan"))
    tl.store(QS + bh.to(tl.int64) * L + offs_m, qs, mask=rmask)
    tl.store(QS + (BH + bh).to(tl.int64) * L + offs_m, inv, mask=rmask)


@triton.jit
def _dkdv_fixed_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, bh, LSE, DELTA, QS, ACC, row_base, sqm, lo, hi,
                      L, S, qk_scale, DIAG: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr, PREC: tl.constexpr, LOADS: tl.constexpr, I64: tl.constexpr,
                      RED: tl.constexpr, BITS: tl.constexpr):
    # attention_triton_bwd_programs._dkdv_inner's products (the same dk, dv bits) and dq's
    # partial of this key block: ACC a [B * H, L, D] descriptor (RED 2) or pointer (RED 1)
    offs_m0 = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        rows = start_m + offs_m0
        q = _tile(q_src, b, h, start_m, rows, sqm, offs_d, L, BM, D, EVEN, I64, LOADS)
        do = _tile(do_src, b, h, start_m, rows, D, offs_d, L, BM, D, EVEN, I64, LOADS)
        if EVEN:
            lse = tl.load(LSE + row_base + rows)
            delta = tl.load(DELTA + row_base + rows)
            qs = tl.load(QS + row_base + rows)
        else:
            lse = tl.load(LSE + row_base + rows, mask=rows < L, other=0.0)
            delta = tl.load(DELTA + row_base + rows, mask=rows < L, other=0.0)
            qs = tl.load(QS + row_base + rows, mask=rows < L, other=0.0)
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
        # dq's partial [BM, D] over this key block; on the grid by truncation toward 0 (|x| < 2^(BITS-3))
        part = _mm(tl.trans(dst), k, PREC) * qs[:, None]
        if BITS == 64:
            fixed = part.to(tl.int64)
        else:
            fixed = part.to(tl.int32)
        if RED == 2:
            if BITS == 64:
                ACC.atomic_add([bh, start_m, 0], tl.reshape(fixed.to(tl.uint64, bitcast=True), [1, BM, D]))
            else:
                ACC.atomic_add([bh, start_m, 0], tl.reshape(fixed, [1, BM, D]))
        else:
            ptr = ACC + row_base * D + rows[:, None] * D + offs_d[None, :]
            if EVEN:
                tl.atomic_add(ptr, fixed, sem="relaxed")
            else:
                tl.atomic_add(ptr, fixed, mask=(rows < L)[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["NB", "BH", "G"])  # one compile for any launch order
def _dkdv_fixed_kernel(Q, K, V, DO, LSE, DELTA, QS, ACC, DK, DV, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                       HK, REP, L, S, qk_scale, sm_scale, NB, BH, G,
                       CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                       PREC: tl.constexpr, EVEN: tl.constexpr, LOADS: tl.constexpr, I64: tl.constexpr,
                       RED: tl.constexpr, BITS: tl.constexpr):
    # attention_triton_bwd_programs._dkdv_program (recompute, no dS store) with dq's partials
    pid_n, bhk = _block_and_head_at(tl.program_id(0), NB, BH, G)
    pid_n = NB - 1 - pid_n  # key block 0 sees every query row: the most work
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
        bh = b * H + h
        if LOADS:
            q_src = Q
            do_src = DO
        else:
            q_src = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_src = DO + bh.to(tl.int64) * L * D  # dO is contiguous [B, H, L, D]
        row_base = bh.to(tl.int64) * L
        if CAUSAL:
            lo = tl.minimum(n0, L)
            mid = tl.minimum(n0 + BN, L)
            dk, dv = _dkdv_fixed_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, bh, LSE, DELTA, QS, ACC, row_base,
                                       sqm, lo, mid, L, S, qk_scale, True, EVEN, BM, BN, D, PREC, LOADS, I64, RED,
                                       BITS)
            dk, dv = _dkdv_fixed_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, bh, LSE, DELTA, QS, ACC, row_base,
                                       sqm, mid, L, L, S, qk_scale, False, EVEN, BM, BN, D, PREC, LOADS, I64, RED,
                                       BITS)
        else:
            dk, dv = _dkdv_fixed_inner(dk, dv, k, v, offs_n, q_src, do_src, b, h, bh, LSE, DELTA, QS, ACC, row_base,
                                       sqm, 0, L, L, S, qk_scale, False, EVEN, BM, BN, D, PREC, LOADS, I64, RED, BITS)
    hb = bhk.to(tl.int64) * S * D
    out = offs_n[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(DK + hb + out, (dk * sm_scale).to(DK.dtype.element_ty))
        tl.store(DV + hb + out, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + hb + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask)
        tl.store(DV + hb + out, dv.to(DV.dtype.element_ty), mask=nmask)


@triton.jit(do_not_specialize=["NB", "BH"])
def _dq_fixed_out_kernel(ACC, QS, DQ, L, sm_scale, NB, BH, BM: tl.constexpr, D: tl.constexpr,
                         EVEN: tl.constexpr):
    # dq = acc (rounded to fp32 once) * 2^-s (exact: a power of two, the result normal) * scale
    pid_m, bh = _block_and_head(NB, BH, 1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    rmask = offs_m < L
    io = bh.to(tl.int64) * L * D + offs_m[:, None] * D + tl.arange(0, D)[None, :]
    if EVEN:
        acc = tl.load(ACC + io)
        inv = tl.load(QS + (BH + bh).to(tl.int64) * L + offs_m)
    else:
        acc = tl.load(ACC + io, mask=rmask[:, None], other=0)
        inv = tl.load(QS + (BH + bh).to(tl.int64) * L + offs_m, mask=rmask, other=0.0)
    dq = (acc.to(tl.float32) * inv[:, None]) * sm_scale
    if EVEN:
        tl.store(DQ + io, dq.to(DQ.dtype.element_ty))
    else:
        tl.store(DQ + io, dq.to(DQ.dtype.element_ty), mask=rmask[:, None])


def fixed_pass(do, q, k, v, o, lse, causal: bool, scale: float, cfg):
    """-> (dq, dk, dv) by the one-pass backward (AttnConfig.dq_fixed = 64 or 32 bits); q/k/v
    with unit last stride, dO and O contiguous [B, H, L, D]."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    bits = cfg.dq_fixed
    dev = q.device
    # exact maxima (a max rounds nothing), their product rounded once: inside the bound's margin
    kv = (k.abs().amax((2, 3)).float() * v.abs().amax((2, 3)).float()).reshape(-1).contiguous()
    delta = torch.empty(B * H, L, dtype=torch.float32, device=dev)
    qs = torch.empty(2, B * H, L, dtype=torch.float32, device=dev)
    nq = triton.cdiv(L, cfg.q_m)
    _prep_kernel[(nq * B * H,)](o, do, kv, delta, qs, L, H // Hk, nq, B * H, BM=cfg.q_m, D=D,
                                EVEN=L % cfg.q_m == 0, BITS=bits, num_warps=cfg.q_warps)
    acc = torch.zeros(B * H, L, D, dtype=torch.int64 if bits == 64 else torch.int32, device=dev)
    red = 2 if BULK and tma_ok(acc) and dev.type == "cuda" else 1  # the interpreter has no bulk reductions
    acc_arg = desc(acc.view(torch.uint64) if bits == 64 else acc, cfg.kv_m) if red == 2 else acc
    loads = cfg.bwd_tma and tma_ok(q, do)
    qd, dod = (desc(q, cfg.kv_m), desc(do, cfg.kv_m)) if loads else (q, do)
    dk = torch.empty(B, Hk, S, D, dtype=k.dtype, device=dev)
    dv = torch.empty(B, Hk, S, D, dtype=v.dtype, device=dev)
    nk = triton.cdiv(S, cfg.kv_n)
    _dkdv_fixed_kernel[(nk * B * Hk,)](
        qd, k, v, dod, lse, delta, qs, acc_arg, dk, dv, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), Hk, H // Hk, L, S, scale * LOG2E, scale,
        nk, B * Hk, min(cfg.kv_group, B * Hk),
        CAUSAL=causal, BM=cfg.kv_m, BN=cfg.kv_n, D=D, PREC=_prec(q), EVEN=L % cfg.kv_m == 0 and S % cfg.kv_n == 0,
        LOADS=loads, I64=wide(q, k, v, do), RED=red, BITS=bits, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=dev)
    _dq_fixed_out_kernel[(nq * B * H,)](acc, qs, dq, L, scale, nq, B * H, BM=cfg.q_m, D=D, EVEN=L % cfg.q_m == 0,
                                        num_warps=cfg.q_warps)
    return dq, dk, dv


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
