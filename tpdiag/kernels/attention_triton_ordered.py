"""The ordered-dq backward of invariant attention (AttnConfig.dq_ordered; a candidate, not shipped).

One program per (batch, KV head, key block) - the dk/dv pass's program, its tiles, its query
blocks in its order - also multiplies each block's dS by K and adds that dq partial (fp32) into a
scratch row block in global memory: 5 block products per (query, key) block pair, as an atomic dq
(FlashAttention, cuDNN) runs, where the recompute backward runs 7. An atomic dq adds the key
blocks' partials in whatever order they arrive (its bits change run to run); here each query
block's partials are added in ONE fixed order, kept by a counter per (batch, query head, query
block): the adder of rank k waits until the counter reads k, adds, and sets it to k + 1.

The order is key blocks from the highest down (rank = nmax(m) - n, nmax(m) the last key block
that query block m sees), chosen so that nobody waits in the steady state: key block n walks
its query blocks upward from the diagonal, so it reaches query block m one step after key block
n + 1 did - exactly when its turn comes. The rank depends on (m, n, L, S and the tiles) only,
never on the program id, B or H: the sum is the same for every TP degree, batch split and run.
The first adder stores (no memset), the others add by relaxed atomics (each element gets one
add per rank, in rank order: the fp32 sum is fixed), and the last (key block 0) reads the sum
back, adds its own and writes dq rounded once (or a cast pass does, `cast_pass`).

Deadlock freedom: a program waits only on key block n + 1 of its own head, launched before it
(the grid puts key blocks from the highest down; CUDA starts blocks in launch order in practice,
as FlashAttention 3's deterministic backward also relies on), which itself waits only on programs
launched earlier still. The Triton interpreter runs programs one by one in launch order: every
predecessor has finished, so a wait is satisfied at once. Every wait is bounded (`limit` polls):
past it the program sets an error flag and goes on, and the caller raises (CPU) or fails a
device-side assert (CUDA) - never a hang.

Waiting, two ways (dq_ordered): 1 - PTX as inline asm: every thread spins on ld.acquire.gpu
and, after its adds, releases them itself by red.release.gpu (+1 a thread, so rank k's turn is
at 32 * warps * k): no CTA barrier and no nested loop in the step loop, which keeps Triton's
software pipelining of its loads (a barrier there or a `while` loop loses it; `attention --sass`
shows it); 2 - Triton's atomic_cas loop behind a barrier, one count per adder (what the
interpreter always runs; a GPU comparison). The first adder's store, the others' adds and the
last one's read-back are masked by the rank, never branched on (Triton 3.6's pipeliner fails on
stores inside an if in the loop). Non-causal calls keep the same order and stay correct, but
there every key block walks every query block from the first, so key block n waits on n + 1
from its first step: tuned for causal only. Imports Triton at import time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpdiag.errors import EnvironmentProblem
from tpdiag.kernels.attention_triton import (LOG2E, AttnConfig, _block_and_head_at, _load_rows, _mm, _prec, _tile,
                                             wide)

# polls before a wait gives up: ~seconds on a GPU; the interpreter's predecessors have always run
GPU_LIMIT = 1 << 24

# ld.acquire.gpu until the counter reaches $2 or $3 polls pass; $0: the last value read. ${:uid}:
# a label of its own wherever the compiler copies this asm
_WAIT_PTX = tl.constexpr("""{
.reg .pred wp;
.reg .u32 wn;
mov.u32 wn, 0;
WAIT${:uid}:
ld.acquire.gpu.global.u32 $0, [$1];
add.u32 wn, wn, 1;
setp.ge.u32 wp, $0, $2;
@wp bra DONE${:uid};
setp.lt.u32 wp, wn, $3;
@wp bra WAIT${:uid};
DONE${:uid}:
}""")
_RELEASE_PTX = tl.constexpr("red.release.gpu.global.add.u32 [$1], 1;\nmov.u32 $0, 0;")


@triton.jit
def _wait(lock, k, ERR, limit, SYNC: tl.constexpr, NT: tl.constexpr):
    # until rank k's turn at `lock` (acquire: the earlier adders' adds are visible after).
    # SYNC 1: every thread polls and every thread of an adder releases its own adds (no CTA
    # barrier in the step loop: one costs Triton its pipelining of the loop's loads), so rank k's
    # turn is NT * k; SYNC 2: a barrier, then one count per adder
    if SYNC == 1:
        c = tl.inline_asm_elementwise(_WAIT_PTX, "=r,l,r,r", [lock, k * NT, limit], dtype=tl.int32,
                                      is_pure=False, pack=1)
        bad = c < k * NT
    else:
        c = tl.atomic_cas(lock, k, k, sem="acquire")
        i = 1
        while (c != k) & (i < limit):
            c = tl.atomic_cas(lock, k, k, sem="acquire")
            i += 1
        bad = c != k
    if bad:
        tl.atomic_xchg(ERR, 1)


@triton.jit
def _release(lock, k, SYNC: tl.constexpr):
    # the next rank's turn once this adder's adds are visible
    if SYNC == 1:
        # each thread: red.release.gpu, +1 (its own adds before it)
        tl.inline_asm_elementwise(_RELEASE_PTX, "=r,l", [lock], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.debug_barrier()  # every thread's adds issued before the counter moves on
        tl.atomic_xchg(lock, k, sem="release")


@triton.jit
def _ordered_inner(dk, dv, k, v, offs_n, pid_n, q_src, do_src, b, h, LSE, DELTA, ACC, DQ, lock_base, ERR, row_base,
                   sqm, lo, hi, L, S, NB, qk_scale, sm_scale, limit, CAUSAL: tl.constexpr, DIAG: tl.constexpr,
                   EVEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                   I64: tl.constexpr, SYNC: tl.constexpr, FINAL: tl.constexpr, ASCEND: tl.constexpr,
                   NT: tl.constexpr):
    # the dk/dv pass's step (_dkdv_inner: the same products in the same order, so dk and dv keep
    # its bits) plus this key block's dq partial, added in rank order
    offs_m0 = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        rows = start_m + offs_m0
        q = _tile(q_src, b, h, start_m, rows, sqm, offs_d, L, BM, D, EVEN, I64, False)
        do = _tile(do_src, b, h, start_m, rows, D, offs_d, L, BM, D, EVEN, I64, False)
        if EVEN:
            lse = tl.load(LSE + row_base + rows)
            delta = tl.load(DELTA + row_base + rows)
        else:
            lse = tl.load(LSE + row_base + rows, mask=rows < L, other=0.0)
            delta = tl.load(DELTA + row_base + rows, mask=rows < L, other=0.0)
        st = _mm(k, tl.trans(q), PREC) * qk_scale  # [BN, BM]
        pt = tl.math.exp2(st - lse[None, :])
        if DIAG:
            pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
        if not EVEN:
            # padded keys too: their dS must be exactly 0 in dq's sum
            pt = tl.where((rows[None, :] < L) & (offs_n[:, None] < S), pt, 0.0)
        dv += _mm(pt.to(do.dtype), do, PREC)
        dpt = _mm(v, tl.trans(do), PREC)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk += _mm(dst, q, PREC)
        part = _mm(tl.trans(dst), k, PREC)  # [BM, D] fp32: this key block's dq partial
        # the key blocks query block m sees: 0 .. nmax (BN is a multiple of BM: a query block
        # never straddles a key block's diagonal start)
        if CAUSAL:
            nmax = tl.minimum(NB - 1, (start_m + BM - 1) // BN)
        else:
            nmax = NB - 1
        if ASCEND:  # the negative control's order (key block 0 first)
            rank = pid_n
        else:
            rank = nmax - pid_n
        lock = lock_base + start_m // BM
        if I64:
            io = rows[:, None].to(tl.int64) * D + offs_d[None, :]
        else:
            io = rows[:, None] * D + offs_d[None, :]
        if EVEN:
            rmask = tl.full([BM, D], 1, tl.int1)  # no row past L: uniform predicates only
        else:
            rmask = tl.broadcast_to(rows[:, None] < L, [BM, D])
        acc_base = ACC + row_base * D  # ACC and DQ: [B * H * L, D], contiguous
        dq_base = DQ + row_base * D
        if rank > 0:
            _wait(lock, rank, ERR, limit, SYNC, NT)
        # where each piece goes, by masks rather than branches (Triton 3.6's pipeliner fails on
        # stores inside an if in the loop): the first adder stores, the others add, the last
        # (FINAL) reads the sum back and writes dq instead
        # (tl.where of a scalar condition: the interpreter takes no `&` of a mask and a scalar)
        if FINAL:
            last = rank == nmax
            # volatile: read after this iteration's wait, never prefetched by the pipeliner
            prev = tl.load(acc_base + io, mask=tl.where(last & (rank > 0), rmask, False), other=0.0,
                           volatile=True)
            tl.store(dq_base + io, ((part + prev) * sm_scale).to(DQ.dtype.element_ty),
                     mask=tl.where(last, rmask, False))
            more = tl.where(last, False, rmask)
        else:
            more = rmask
        tl.store(acc_base + io, part, mask=tl.where(rank == 0, more, False))
        tl.atomic_add(acc_base + io, part, mask=tl.where(rank > 0, more, False), sem="relaxed")
        _release(lock, rank + 1, SYNC)  # after the last adder too: nobody waits for that count
    return dk, dv


@triton.jit(do_not_specialize=["NB", "BH", "G", "limit"])
def _ordered_kernel(Q, K, V, DO, LSE, DELTA, ACC, DQ, DK, DV, LOCK, ERR, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                    HK, REP, L, S, NM, qk_scale, sm_scale, NB, BH, G, limit,
                    CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                    EVEN: tl.constexpr, I64: tl.constexpr, SYNC: tl.constexpr, FINAL: tl.constexpr,
                    ASCEND: tl.constexpr, NT: tl.constexpr):
    # launch order: key blocks from the highest down, heads in groups of G (_block_and_head_at):
    # key block n + 1 of a head always launches before key block n (ASCEND: the other way round)
    blk, bhk = _block_and_head_at(tl.program_id(0), NB, BH, G)
    if ASCEND:
        pid_n = NB - 1 - blk
    else:
        pid_n = blk
    b = bhk // HK
    hk = bhk % HK
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    k = _load_rows(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh, offs_n, skn, offs_d, S, EVEN, I64)
    v = _load_rows(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh, offs_n, svn, offs_d, S, EVEN, I64)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    H = HK * REP
    for r in range(0, REP):  # this KV head's query heads, in head order
        h = hk * REP + r
        q_src = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_src = DO + (b * H + h).to(tl.int64) * L * D  # dO is contiguous [B, H, L, D]
        row_base = (b * H + h).to(tl.int64) * L
        lock_base = LOCK + (b * H + h).to(tl.int64) * NM
        if CAUSAL:
            # rows [n0, n0 + BN) straddle the diagonal; later rows see the whole key block
            lo = tl.minimum(n0, L)
            mid = tl.minimum(n0 + BN, L)
            dk, dv = _ordered_inner(dk, dv, k, v, offs_n, pid_n, q_src, do_src, b, h, LSE, DELTA, ACC, DQ, lock_base,
                                    ERR, row_base, sqm, lo, mid, L, S, NB, qk_scale, sm_scale, limit, CAUSAL, True,
                                    EVEN, BM, BN, D, PREC, I64, SYNC, FINAL, ASCEND, NT)
            dk, dv = _ordered_inner(dk, dv, k, v, offs_n, pid_n, q_src, do_src, b, h, LSE, DELTA, ACC, DQ, lock_base,
                                    ERR, row_base, sqm, mid, L, L, S, NB, qk_scale, sm_scale, limit, CAUSAL, False,
                                    EVEN, BM, BN, D, PREC, I64, SYNC, FINAL, ASCEND, NT)
        else:
            dk, dv = _ordered_inner(dk, dv, k, v, offs_n, pid_n, q_src, do_src, b, h, LSE, DELTA, ACC, DQ, lock_base,
                                    ERR, row_base, sqm, 0, L, L, S, NB, qk_scale, sm_scale, limit, CAUSAL, False,
                                    EVEN, BM, BN, D, PREC, I64, SYNC, FINAL, ASCEND, NT)
    hb = bhk.to(tl.int64) * S * D
    out = offs_n[:, None] * D + offs_d[None, :]
    if EVEN:
        tl.store(DK + hb + out, (dk * sm_scale).to(DK.dtype.element_ty))
        tl.store(DV + hb + out, dv.to(DV.dtype.element_ty))
    else:
        nmask = offs_n[:, None] < S
        tl.store(DK + hb + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask)
        tl.store(DV + hb + out, dv.to(DV.dtype.element_ty), mask=nmask)


@triton.jit
def _cast_kernel(ACC, DQ, n, sm_scale, BLOCK: tl.constexpr):
    # dq = (sum * scale) rounded to dq's dtype: the last adder's rounding, as a pass (cast_pass)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ACC + offs, mask=offs < n, other=0.0)
    tl.store(DQ + offs, (x * sm_scale).to(DQ.dtype.element_ty), mask=offs < n)


def ordered_pass(do, q, k, v, lse, delta, causal: bool, scale: float, cfg: AttnConfig, ascend: bool = False,
                 limit: int | None = None):
    """-> (dq, dk, dv) in one launch from delta (delta_pass); q/k/v with unit last stride, dO
    contiguous. `ascend`: the negative control's order (key block 0 adds first) - another fixed
    order, other dq bits; `limit`: polls per wait (tests)."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    dev = q.device
    BM, BN = cfg.kv_m, cfg.kv_n
    nm, nk = triton.cdiv(L, BM), triton.cdiv(S, BN)
    dq = torch.empty(B, H, L, D, dtype=q.dtype, device=dev)
    dk = torch.empty(B, Hk, S, D, dtype=k.dtype, device=dev)
    dv = torch.empty(B, Hk, S, D, dtype=v.dtype, device=dev)
    final = not cfg.cast_pass
    # the first adder of each element stores: no memset (the last adder never writes it when final)
    acc = torch.empty(B * H * L * D, dtype=torch.float32, device=dev)
    lock = torch.zeros(B * H * nm, dtype=torch.int32, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    interp = dev.type == "cpu"
    sync = 2 if interp else cfg.dq_ordered
    limit = limit or (2 if interp else GPU_LIMIT)
    _ordered_kernel[(nk * B * Hk,)](
        q, k, v, do, lse, delta, acc, dq, dk, dv, lock, err, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), Hk, H // Hk, L, S, nm,
        scale * LOG2E, scale, nk, B * Hk, min(cfg.kv_group, B * Hk), limit,
        CAUSAL=causal, BM=BM, BN=BN, D=D, PREC=_prec(q), EVEN=L % BM == 0 and S % BN == 0,
        I64=wide(q, k, v, do), SYNC=sync, FINAL=final, ASCEND=ascend, NT=32 * cfg.kv_warps,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    if interp:
        if err.item():
            raise EnvironmentProblem("invariant attention's ordered dq: a wait found its predecessor not run "
                                     "(the launch order is broken)")
    else:
        torch._assert_async(err[0] == 0, "invariant attention's ordered dq: a wait timed out")
    if not final:
        _cast_kernel[(triton.cdiv(acc.numel(), 4096),)](acc, dq, acc.numel(), scale, BLOCK=4096)
    return dq, dk, dv
