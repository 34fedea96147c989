"""The backward of invariant attention in Triton (CUDA; the Triton interpreter runs it on the CPU).

Why it is invariant and deterministic: no atomics, and every program reads its own head's rows
only, with tiles fixed per (head_dim, dtype) (attention_triton.config_for). One dk/dv program per
(batch, KV head, key block) loops over its query heads in head order and over the query blocks
in a fixed order. dq comes one of two ways (AttnConfig.ds_mib), each deterministic:
- recompute (ds_mib = 0): a dq program per (batch, query head, row block) recomputes P and dP
  and loops over the key blocks in a fixed order - 7 block products per (query, key) block pair
  where an atomic dq needs 5. It runs first and also writes delta = rowsum(O * dO).
- stored dS (ds_mib > 0): the dk/dv pass also stores dS (the input dtype, rounded as the dK
  product uses it), and a dq program reads its row block of dS back and multiplies by K over the
  key blocks in a fixed order - 5 products and a write and read of dS (O(L * S) memory per head,
  so heads go in chunks whose dS fits ds_mib MiB; a head's sums are its own, so the chunking
  moves no bit). delta comes from its own small pass first.
The recompute path may also run as one launch (AttnConfig.bwd_fused), and the two ways may share
the work (AttnConfig.ds_every): attention_triton_bwd_programs.py, with the programs' bodies.

One-pass backwards without the recompute were built, checked bitwise and measured slower on an
H200 (B8 S4096 H32 D64 bf16 causal, against 4.08 ms for the two recompute passes): dq partials
added in key-block order behind a per-query-block counter (commit eefece6), 8.5-9.8 ms - the
wait, L2 read and release fence sit on every step's critical path; dq partials as int64 atomics
on a per-row fixed-point grid (commit 31ddac7), 7.0-10.9 ms. TMA descriptor loads in the loops
(AttnConfig.bwd_tma, and dq_tma for the dq recompute loop: the same bits) pay at head_dim 128; at
D=64 only with 4-head launch groups, 1-2% (docs/benchmarks.md). Imports Triton at import time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpdiag.kernels.attention_triton import (LOG2E, AttnConfig, _block_and_head, _last_dim_unit, _mm, _prec,
                                             _tile, config_for, desc, tma_ok, wide)
from tpdiag.kernels.attention_triton_bwd_programs import (_dkdv_program, _do_and_delta, _dq_mix_kernel,
                                                          _dq_program, _fused_kernel)

@triton.jit(do_not_specialize=["NB", "BH", "G", "BH0"])  # one compile for any launch order
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DS, CTR, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                 HK, REP, L, S, qk_scale, sm_scale, NB, BH, G, BH0,
                 CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 PREC: tl.constexpr, EVEN: tl.constexpr, STORE_DS: tl.constexpr, LOADS: tl.constexpr,
                 I64: tl.constexpr, DS_EVERY: tl.constexpr, SOFT: tl.constexpr = 0, DEG: tl.constexpr = 3,
                 PERSIST: tl.constexpr = False, SPLIT: tl.constexpr = False):
    # PERSIST: fewer programs than tiles, each taking the next tile from the counter CTR (zeroed
    # by the caller) until NB * BH are taken (AttnConfig.persist: a tile's sums do not depend on
    # which program runs it)
    if PERSIST:
        t = tl.atomic_add(CTR, 1)
        while t < NB * BH:
            _dkdv_program(t, Q, K, V, DO, LSE, DELTA, DK, DV, DS, sqb, sqh, sqm, skb, skh, skn, svb, svh,
                          svn, HK, REP, L, S, qk_scale, sm_scale, NB, BH, G, BH0, CAUSAL, BM, BN, D, PREC, EVEN,
                          STORE_DS, LOADS, I64, DS_EVERY, SOFT, DEG, SPLIT)
            t = tl.atomic_add(CTR, 1)
    else:
        _dkdv_program(tl.program_id(0), Q, K, V, DO, LSE, DELTA, DK, DV, DS, sqb, sqh, sqm, skb, skh, skn, svb,
                      svh, svn, HK, REP, L, S, qk_scale, sm_scale, NB, BH, G, BH0, CAUSAL, BM, BN, D, PREC, EVEN,
                      STORE_DS, LOADS, I64, DS_EVERY, SOFT, DEG, SPLIT)


@triton.jit(do_not_specialize=["NB", "BH", "G"])  # one compile for any launch order
def _dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, CTR, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
               H, REP, L, S, qk_scale, sm_scale, NB, BH, G,
               CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               PREC: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr, SOFT: tl.constexpr = 0,
               DEG: tl.constexpr = 3, LOADS: tl.constexpr = False, PERSIST: tl.constexpr = False):
    # LOADS: K and V are [B, Hk, S, D] descriptors (AttnConfig.dq_tma); PERSIST as _dkdv_kernel's
    if PERSIST:
        t = tl.atomic_add(CTR, 1)
        while t < NB * BH:
            _dq_program(t, Q, K, V, O, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                        H, REP, L, S, qk_scale, sm_scale, NB, BH, G, CAUSAL, BM, BN, D, PREC, EVEN, I64, True, SOFT,
                        DEG, LOADS)
            t = tl.atomic_add(CTR, 1)
    else:
        _dq_program(tl.program_id(0), Q, K, V, O, DO, LSE, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                    H, REP, L, S, qk_scale, sm_scale, NB, BH, G, CAUSAL, BM, BN, D, PREC, EVEN, I64, True, SOFT, DEG,
                    LOADS)


@triton.jit(do_not_specialize=["NB", "BH"])
def _delta_kernel(O, DO, DELTA, L, NB, BH, BM: tl.constexpr, D: tl.constexpr, EVEN: tl.constexpr):
    # delta = rowsum(O * dO) in fp32, one fixed order per row (the dq recompute pass's own sum)
    pid_m, bh = _block_and_head(NB, BH, 1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    hb = bh.to(tl.int64) * L * D
    _, delta = _do_and_delta(O + hb, DO + hb, offs_m[:, None] * D + offs_d[None, :], offs_m < L, EVEN)
    tl.store(DELTA + bh.to(tl.int64) * L + offs_m, delta, mask=offs_m < L)


@triton.jit
def _dq_ds_inner(dq, DS, ds_idx, k_src, b, hk, skn, offs_m, m0, lo, hi, L, S, DIAG: tl.constexpr,
                 EVEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 PREC: tl.constexpr, TMA: tl.constexpr, LOADS: tl.constexpr, I64: tl.constexpr):
    # LOADS: k_src is a [B, Hk, S, D] descriptor, else this KV head's base pointer
    offs_n0 = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n0
        k = _tile(k_src, b, hk, start_n, cols, skn, offs_d, S, BN, D, EVEN, I64, LOADS)
        if TMA:  # DS a [heads, S, L] descriptor; out of bounds reads as 0
            dst = tl.reshape(DS.load([ds_idx, start_n, m0]), [BN, BM])
        else:
            ptrs = DS + ds_idx.to(tl.int64) * S * L + cols[:, None].to(tl.int64) * L + offs_m[None, :]
            if EVEN:
                dst = tl.load(ptrs)
            else:
                dst = tl.load(ptrs, mask=(cols[:, None] < S) & (offs_m[None, :] < L), other=0.0)
        if DIAG:
            # above the diagonal the dk/dv pass wrote nothing: whatever is there reads as 0
            dst = tl.where(cols[:, None] <= offs_m[None, :], dst, 0.0)
        dq += _mm(tl.trans(dst), k, PREC)
    return dq


@triton.jit(do_not_specialize=["NB", "BH", "G", "BH0"])  # one compile for any launch order
def _dq_ds_kernel(DS, K, DQ, skb, skh, skn, H, REP, L, S, sm_scale, NB, BH, G, BH0,
                  CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                  PREC: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, LOADS: tl.constexpr,
                  I64: tl.constexpr):
    # dq of row block pid_m = sum over key blocks, in order from 0, of dS[rows, keys] @ K[keys]
    pid_m, bhl = _block_and_head(NB, BH, G)
    bh = BH0 + bhl
    b = bh // H
    hk = (bh % H) // REP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    if LOADS:
        k_src = K
    else:
        k_src = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    dq = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        diag = tl.minimum(m0, S)  # BM is a multiple of BN
        dq = _dq_ds_inner(dq, DS, bhl, k_src, b, hk, skn, offs_m, m0, 0, diag, L, S, False, EVEN, BM, BN, D,
                          PREC, TMA, LOADS, I64)
        dq = _dq_ds_inner(dq, DS, bhl, k_src, b, hk, skn, offs_m, m0, diag, tl.minimum(m0 + BM, S), L, S,
                          True, EVEN, BM, BN, D, PREC, TMA, LOADS, I64)
    else:
        dq = _dq_ds_inner(dq, DS, bhl, k_src, b, hk, skn, offs_m, m0, 0, S, L, S, False, EVEN, BM, BN, D,
                          PREC, TMA, LOADS, I64)
    dq_ptr = DQ + bh.to(tl.int64) * L * D + offs_m[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < L)


def backward(do, q, k, v, o, lse, causal: bool, scale: float, cfg: AttnConfig | None = None):
    """-> (dq, dk, dv) from the forward's (o, lse); dq by the path cfg.ds_mib names."""
    cfg = cfg or config_for(q.dtype, q.shape[-1])
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    if k.shape[2] == 0:  # no keys: the forward gave zeros
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), torch.zeros_like(k), torch.zeros_like(v)
    do = do.contiguous()
    if stores_ds(cfg, q.shape[2], k.shape[2], q.element_size()) and q.numel() and k.numel():
        return _backward_ds(do, q, k, v, o, lse, causal, scale, cfg)
    if cfg.bwd_fused and q.numel() and k.numel():
        return fused_pass(do, q, k, v, o, lse, causal, scale, cfg)
    # dq first: it also writes delta, which the dk/dv pass reads
    dq, delta = dq_pass(do, q, k, v, o, lse, causal, scale, cfg)
    return (dq,) + dkdv_pass(do, q, k, v, lse, delta, causal, scale, cfg, loads=cfg.bwd_tma)


def stores_ds(cfg: AttnConfig, L: int, S: int, itemsize: int) -> bool:
    """Whether dq comes from stored dS: one query head's fits the budget. By L, S, the dtype and
    the budget only - not by the heads per KV head, which TP changes where KV heads are
    replicated (the two paths gave the same bits wherever measured, but are not built to)."""
    return bool(cfg.ds_mib) and L * S * itemsize <= cfg.ds_mib << 20


def ds_chunk(cfg: AttnConfig, rep: int, L: int, S: int, itemsize: int) -> int:
    """(batch, KV head) pairs per chunk of the stored-dS backward: their query heads' dS fit
    cfg.ds_mib MiB, and at least one pair (whose rep query heads' dS may then exceed it)."""
    return max(1, (cfg.ds_mib << 20) // max(1, rep * L * S * itemsize))


def _backward_ds(do, q, k, v, o, lse, causal, scale, cfg, chunk: int | None = None, ds=None):
    """`chunk` and a prefilled `ds` scratch: for tests (neither moves a bit)."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    rep = H // Hk
    delta = delta_pass(do, o, cfg)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hk, S, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hk, S, D, dtype=v.dtype, device=q.device)
    chunk = min(chunk or ds_chunk(cfg, rep, L, S, q.element_size()), B * Hk)
    if ds is None:
        ds = torch.empty(chunk * rep, S, L, dtype=q.dtype, device=q.device)
    tma = tma_ok(ds)
    for c0 in range(0, B * Hk, chunk):
        n = min(chunk, B * Hk - c0)
        dkdv_pass(do, q, k, v, lse, delta, causal, scale, cfg, out=(dk, dv), ds=ds, bh0=c0, nbh=n, tma=tma,
                  loads=cfg.bwd_tma)
        if cfg.ds_every > 1:
            dq_mix_pass(ds, do, q, k, v, lse, delta, dq, causal, scale, cfg, bh0=c0 * rep, nbh=n * rep)
        else:
            dq_ds_pass(ds, k, dq, causal, scale, cfg, bh0=c0 * rep, nbh=n * rep, tma=tma, loads=cfg.bwd_tma)
    return dq, dk, dv


def dq_ds_pass(ds, k, dq, causal: bool, scale: float, cfg: AttnConfig, bh0: int, nbh: int,
               tma: bool = False, loads: bool = False):
    """dq of query (batch, head) pairs bh0 .. bh0 + nbh - 1 into `dq` [B, H, L, D] from their
    dS^T in `ds` ([nbh, S, L], as dkdv_pass stores it) and K; `tma`: dS read by TMA; `loads`:
    K by TMA where tma_ok."""
    _, H, L, D = dq.shape
    Hk, S = k.shape[1], k.shape[2]
    nq = triton.cdiv(L, cfg.q_m)
    ds_arg = desc(ds, cfg.q_n, cfg.q_m) if tma else ds
    loads = loads and tma_ok(k)
    _dq_ds_kernel[(nq * nbh,)](
        ds_arg, desc(k, cfg.q_n) if loads else k, dq, k.stride(0), k.stride(1), k.stride(2), H, H // Hk, L, S, scale,
        nq, nbh, min(cfg.q_group, nbh), bh0,
        CAUSAL=causal, BM=cfg.q_m, BN=cfg.q_n, D=D, PREC=_prec(dq),
        EVEN=L % cfg.q_m == 0 and S % cfg.q_n == 0, TMA=tma, LOADS=loads, I64=wide(k),
        num_warps=cfg.qds_warps or cfg.q_warps, num_stages=cfg.q_stages)
    return dq


def dq_mix_pass(ds, do, q, k, v, lse, delta, dq, causal: bool, scale: float, cfg: AttnConfig, bh0: int,
                nbh: int):
    """dq of query (batch, head) pairs bh0 .. bh0 + nbh - 1 into `dq`: from their stored dS^T in
    `ds` for the key blocks the dk/dv pass kept (AttnConfig.ds_every), recomputed for the rest;
    dO contiguous, delta from delta_pass. Pointer loads only."""
    _, H, L, D = dq.shape
    Hk, S = k.shape[1], k.shape[2]
    nq = triton.cdiv(L, cfg.q_m)
    _dq_mix_kernel[(nq * nbh,)](
        ds, q, k, v, do, lse, delta, dq, *_strides(q, k, v), H, H // Hk, L, S, scale * LOG2E, scale,
        nq, nbh, min(cfg.q_group, nbh), bh0,
        CAUSAL=causal, BM=cfg.q_m, BN=cfg.q_n, KV_N=cfg.kv_n, EVERY=cfg.ds_every, D=D, PREC=_prec(dq),
        EVEN=L % cfg.q_m == 0 and S % cfg.q_n == 0, I64=wide(q, k, v, do),
        num_warps=cfg.q_warps, num_stages=cfg.q_stages)
    return dq


def delta_pass(do, o, cfg: AttnConfig):
    """delta = rowsum(O * dO), fp32 [B * H, L]; O and dO contiguous [B, H, L, D]."""
    B, H, L, D = o.shape
    delta = torch.empty(B * H, L, dtype=torch.float32, device=o.device)
    nb = triton.cdiv(L, cfg.q_m)
    _delta_kernel[(nb * B * H,)](o, do, delta, L, nb, B * H, BM=cfg.q_m, D=D, EVEN=L % cfg.q_m == 0,
                                 num_warps=cfg.q_warps)
    return delta


def _grid(tiles: int, persist: int, device: torch.device):
    """(grid, tile counter or None) of a backward pass of `tiles` tiles: one program a tile, or
    (AttnConfig.kv_persist / q_persist) `persist` programs per SM - 2 "SMs" under the
    interpreter - taking tiles from a zeroed int32 counter."""
    if not persist:
        return (tiles,), None
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return (max(1, min(tiles, persist * sms)),), torch.zeros(1, dtype=torch.int32, device=device)


def _regs(maxnreg: int) -> dict:
    """The launch's register cap (AttnConfig.kv_maxnreg / q_maxnreg; 0: none)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def _strides(q, k, v):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2))


def dq_pass(do, q, k, v, o, lse, causal: bool, scale: float, cfg: AttnConfig):
    """-> (dq, delta) by recompute; q/k/v with unit last stride, dO and O contiguous."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    delta = torch.empty(B * H, L, dtype=torch.float32, device=q.device)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    nq = triton.cdiv(L, cfg.q_m)
    loads = cfg.dq_tma and tma_ok(k, v)
    kd, vd = (desc(k, cfg.q_n), desc(v, cfg.q_n)) if loads else (k, v)
    grid, ctr = _grid(nq * B * H, cfg.q_persist, q.device)
    _dq_kernel[grid](
        q, kd, vd, o, do, lse, delta, dq, ctr, *_strides(q, k, v), H, H // Hk, L, S, scale * LOG2E, scale,
        nq, B * H, min(cfg.q_group, B * H),
        CAUSAL=causal, BM=cfg.q_m, BN=cfg.q_n, D=D, PREC=_prec(q),
        EVEN=L % cfg.q_m == 0 and S % cfg.q_n == 0, I64=wide(q, k, v, do), SOFT=cfg.soft(1),
        DEG=cfg.exp_soft_deg, LOADS=loads, PERSIST=ctr is not None, num_warps=cfg.q_warps, num_stages=cfg.q_stages,
        **_regs(cfg.q_maxnreg))
    return dq, delta


def dkdv_pass(do, q, k, v, lse, delta, causal: bool, scale: float, cfg: AttnConfig, out=None,
              ds=None, bh0: int = 0, nbh: int | None = None, tma: bool = False, loads: bool = False):
    """-> (dk, dv) of (batch, KV head) pairs bh0 .. bh0 + nbh - 1 (all by default), into `out`
    if given, from the delta of dq_pass or delta_pass; with `ds`, also stores their query heads'
    dS^T there ([nbh * rep, S, L]; by TMA if `tma`); `loads`: q and dO by TMA where tma_ok."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    dk, dv = out if out is not None else (torch.empty(B, Hk, S, D, dtype=k.dtype, device=q.device),
                                          torch.empty(B, Hk, S, D, dtype=v.dtype, device=q.device))
    nbh = B * Hk if nbh is None else nbh
    nk = triton.cdiv(S, cfg.kv_n)
    if ds is None:
        ds_arg, store = dk, 0  # never read (STORE_DS=0)
    else:
        ds_arg, store = (desc(ds, cfg.kv_n, cfg.kv_m), 2) if tma else (ds, 1)
    loads = loads and tma_ok(q, do)
    split = bool(cfg.kv_split) and not store and not cfg.soft(2)  # the split loop stores no dS, exp2 only
    rows = cfg.kv_m // 2 if split else cfg.kv_m
    qd, dod = (desc(q, rows), desc(do, rows)) if loads else (q, do)
    grid, ctr = _grid(nk * nbh, cfg.kv_persist, q.device)
    _dkdv_kernel[grid](
        qd, k, v, dod, lse, delta, dk, dv, ds_arg, ctr, *_strides(q, k, v), Hk, H // Hk, L, S,
        scale * LOG2E, scale, nk, nbh, min(cfg.kv_group, nbh), bh0,
        CAUSAL=causal, BM=cfg.kv_m, BN=cfg.kv_n, D=D, PREC=_prec(q),
        EVEN=L % cfg.kv_m == 0 and S % cfg.kv_n == 0, STORE_DS=store, LOADS=loads, I64=wide(q, k, v, do),
        DS_EVERY=max(1, cfg.ds_every) if store else 1, SOFT=cfg.soft(2), DEG=cfg.exp_soft_deg,
        PERSIST=ctr is not None, SPLIT=split, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
        **_regs(cfg.kv_maxnreg))
    return dk, dv


def fused_pass(do, q, k, v, o, lse, causal: bool, scale: float, cfg: AttnConfig):
    """-> (dq, dk, dv) by recompute in one launch after the delta pass (AttnConfig.bwd_fused);
    q/k/v with unit last stride, dO and O contiguous."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    delta = delta_pass(do, o, cfg)  # complete before any program of the one launch reads it
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hk, S, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hk, S, D, dtype=v.dtype, device=q.device)
    nk, nq = triton.cdiv(S, cfg.kv_n), triton.cdiv(L, cfg.q_m)
    loads = cfg.bwd_tma and tma_ok(q, do)
    qd, dod = (desc(q, cfg.kv_m), desc(do, cfg.kv_m)) if loads else (q, do)
    _fused_kernel[(nk * B * Hk + nq * B * H,)](
        q, qd, k, v, o, do, dod, lse, delta, dq, dk, dv, *_strides(q, k, v), Hk, H // Hk, L, S,
        scale * LOG2E, scale, nk, B * Hk, min(cfg.kv_group, B * Hk), nq, B * H, min(cfg.q_group, B * H),
        CAUSAL=causal, KV_M=cfg.kv_m, KV_N=cfg.kv_n, Q_M=cfg.q_m, Q_N=cfg.q_n, D=D, PREC=_prec(q),
        EVEN_KV=L % cfg.kv_m == 0 and S % cfg.kv_n == 0, EVEN_Q=L % cfg.q_m == 0 and S % cfg.q_n == 0,
        LOADS=loads, I64=wide(q, k, v, do), SOFT_KV=cfg.soft(2), SOFT_Q=cfg.soft(1), DEG=cfg.exp_soft_deg,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    return dq, dk, dv


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
