"""One GEMM whose K is cut into `groups` equal ranges, summed as a balanced tree in registers.

Why: tp-invariant-linear reduces K (row-parallel forward) and N (column-parallel dgrad) as a
tree of fixed global groups whose subtrees are the rank shards (kernels/tree.py). Computed as
one GEMM per group, every group writes an fp32 [tokens, N] tensor that the tree then reads back:
at batch 8 x seq 4096 those partials, not the arithmetic, were the fix's cost. Here each output
tile accumulates group g's K range into its own fp32 accumulator (K walked upwards in BLOCK_K
steps from the group's start, the same steps at every TP) and combines the accumulators in the
fixed pairing ((g0+g1)+(g2+g3))+... before anything is stored: one fp32 [M, N] subtree root
per rank, no per-group tensors, and the bits of every group sum and every tree node do not
depend on how many groups one call holds - so the rank's subtree root is the same node of the
same tree at every power-of-two TP.

Tiles are fixed per dtype and device (never per shape: another BLOCK_K is other arithmetic).
The CPU (non-Triton) path stays in grouped_linear.py; `reference_tree_mm` is the float64
reference.
"""
from __future__ import annotations

import functools
import os

import torch

from tpdiag.kernels import alloc

triton = None
tl = None


def _group_acc(a_ptr, b_ptr, offs_m, offs_n, k0, KG, stride_am, stride_ak, stride_bk, stride_bn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # one group's K range [k0, k0 + KG) into a fresh fp32 accumulator, BLOCK_K steps upwards
    offs_kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(KG, BLOCK_K)):
        offs_k = k0 + ki * BLOCK_K + offs_kb
        if EVEN_K:  # group starts are multiples of BLOCK_K: vectorised loads along K
            offs_k = tl.max_contiguous(tl.multiple_of(offs_k, BLOCK_K), BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            # zeros past the group's end: exact, and the same at every TP (KG is global)
            a = tl.load(a_ptrs, mask=offs_kb[None, :] < KG - ki * BLOCK_K, other=0.0)
            b = tl.load(b_ptrs, mask=offs_kb[:, None] < KG - ki * BLOCK_K, other=0.0)
        if UPCAST:  # interpreter only: its dot mis-reads bf16 (as in invariant_gemm)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


def _pair_acc(a_ptr, b_ptr, offs_m, offs_n, k0, KG, stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # groups g and g + 1 ([k0, k0 + KG) and [k0 + KG, k0 + 2 KG)) in ONE loop, each into its own
    # accumulator with the same dots in the same order as _group_acc: the same two sums, bit for
    # bit, from one software pipeline instead of two (a group of llama-1b's wo at TP=2, G=8 is 4
    # BLOCK_K steps: each loop's prologue and drain was a large part of it)
    offs_kb = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(KG, BLOCK_K)):
        offs_k0 = k0 + ki * BLOCK_K + offs_kb
        offs_k1 = offs_k0 + KG
        if EVEN_K:
            offs_k0 = tl.max_contiguous(tl.multiple_of(offs_k0, BLOCK_K), BLOCK_K)
            offs_k1 = tl.max_contiguous(tl.multiple_of(offs_k1, BLOCK_K), BLOCK_K)
        a0_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k0[None, :] * stride_ak
        b0_ptrs = b_ptr + offs_k0[:, None] * stride_bk + offs_n[None, :] * stride_bn
        a1_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k1[None, :] * stride_ak
        b1_ptrs = b_ptr + offs_k1[:, None] * stride_bk + offs_n[None, :] * stride_bn
        if EVEN_K:
            a0 = tl.load(a0_ptrs)
            b0 = tl.load(b0_ptrs)
            a1 = tl.load(a1_ptrs)
            b1 = tl.load(b1_ptrs)
        else:
            left = KG - ki * BLOCK_K
            a0 = tl.load(a0_ptrs, mask=offs_kb[None, :] < left, other=0.0)
            b0 = tl.load(b0_ptrs, mask=offs_kb[:, None] < left, other=0.0)
            a1 = tl.load(a1_ptrs, mask=offs_kb[None, :] < left, other=0.0)
            b1 = tl.load(b1_ptrs, mask=offs_kb[:, None] < left, other=0.0)
        if UPCAST:
            a0 = a0.to(tl.float32)
            b0 = b0.to(tl.float32)
            a1 = a1.to(tl.float32)
            b1 = b1.to(tl.float32)
        acc0 = tl.dot(a0, b0, acc0)
        acc1 = tl.dot(a1, b1, acc1)
    return acc0 + acc1


def _tree_mm_kernel(a_ptr, b_ptr, c_ptr, M, N, KG,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                    GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                    PAIRED: tl.constexpr = False, SPILL: tl.constexpr = False):
    # column tiles vary fastest: the programs in flight share one row block of A (read from HBM
    # once) and all of B (weights: small enough to stay in L2). Which program computes a tile,
    # and when, never changes what it computes.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # out-of-range rows/columns read row/column 0 and are masked at the store: a row's bits
    # never depend on what shares its tile
    offs_m = tl.where(offs_m < M, offs_m, 0)
    offs_n = tl.where(offs_n < N, offs_n, 0)
    offs_m = tl.max_contiguous(tl.multiple_of(offs_m, BLOCK_M), BLOCK_M)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    if not PAIRED:  # a loop per group, the pairing as the groups finish
        s = _tree_unpaired(a_ptr, b_ptr, offs_m, offs_n, KG, stride_am, stride_ak, stride_bk,
                           stride_bn, GROUPS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
    else:  # the same tree, each pair of leaves from one loop
        s = _pair_acc(a_ptr, b_ptr, offs_m, offs_n, 0, KG, stride_am, stride_ak, stride_bk,
                      stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        if GROUPS >= 4:
            if SPILL:
                # the finished left pair waits in the output tile (fp32: exact), not in
                # registers, so the next pair's accumulators are the only ones live; the barrier
                # makes the tile's stores visible to the threads that read it back (other
                # layout). a + b == b + a in IEEE: the same node.
                tl.store(c_ptrs, s, mask=c_mask)
                tl.debug_barrier()
                s = _pair_acc(a_ptr, b_ptr, offs_m, offs_n, 2 * KG, KG, stride_am, stride_ak,
                              stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
                s = s + tl.load(c_ptrs, mask=c_mask, other=0.0)
            else:
                s = s + _pair_acc(a_ptr, b_ptr, offs_m, offs_n, 2 * KG, KG, stride_am, stride_ak,
                                  stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        if GROUPS == 8:  # ((p0 + p1) + (p2 + p3))
            if SPILL:
                tl.debug_barrier()
                tl.store(c_ptrs, s, mask=c_mask)
                tl.debug_barrier()
            s2 = _pair_acc(a_ptr, b_ptr, offs_m, offs_n, 4 * KG, KG, stride_am, stride_ak,
                           stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
            s2 = s2 + _pair_acc(a_ptr, b_ptr, offs_m, offs_n, 6 * KG, KG, stride_am, stride_ak,
                                stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
            if SPILL:
                s = tl.load(c_ptrs, mask=c_mask, other=0.0)
            s = s + s2
    if SPILL:  # every thread's read of the parked subtree before any thread overwrites it
        tl.debug_barrier()
    tl.store(c_ptrs, s, mask=c_mask)


def _tree_unpaired(a_ptr, b_ptr, offs_m, offs_n, KG, stride_am, stride_ak, stride_bk, stride_bn,
                   GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # a loop per group, the pairing as the groups finish
    s = _group_acc(a_ptr, b_ptr, offs_m, offs_n, 0, KG, stride_am, stride_ak, stride_bk,
                   stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
    if GROUPS >= 2:
        s = s + _group_acc(a_ptr, b_ptr, offs_m, offs_n, KG, KG, stride_am, stride_ak,
                           stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
    if GROUPS >= 4:
        s23 = _group_acc(a_ptr, b_ptr, offs_m, offs_n, 2 * KG, KG, stride_am, stride_ak,
                         stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        s23 = s23 + _group_acc(a_ptr, b_ptr, offs_m, offs_n, 3 * KG, KG, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        s = s + s23
    if GROUPS == 8:
        s45 = _group_acc(a_ptr, b_ptr, offs_m, offs_n, 4 * KG, KG, stride_am, stride_ak,
                         stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        s45 = s45 + _group_acc(a_ptr, b_ptr, offs_m, offs_n, 5 * KG, KG, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        s67 = _group_acc(a_ptr, b_ptr, offs_m, offs_n, 6 * KG, KG, stride_am, stride_ak,
                         stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        s67 = s67 + _group_acc(a_ptr, b_ptr, offs_m, offs_n, 7 * KG, KG, stride_am, stride_ak,
                               stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST)
        s = s + (s45 + s67)
    return s


@functools.lru_cache(maxsize=None)
def _kernels():
    global triton, tl
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    from tpdiag.kernels.interpreter_patch import lighten

    lighten()  # the interpreter's per-helper re-patching skipped (interpreter_patch.py)
    for name in ("_group_acc", "_pair_acc", "_tree_unpaired"):
        globals()[name] = _triton.jit(globals()[name])
    return _triton.jit(_tree_mm_kernel)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per dtype; 128 x 64 so that the up to four
# live fp32 accumulators of an 8-group tile fit in registers at 8 warps (32 each per thread)
_CUDA_TILES = {torch.bfloat16: (128, 64, 64, 8, 3), torch.float16: (128, 64, 64, 8, 3)}
_INTERPRETER_TILES = (16, 16, 16, 4, 1)


def supported(a: torch.Tensor, b: torch.Tensor, groups: int) -> bool:
    return (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
            and groups in (1, 2, 4, 8) and a.shape[-1] % groups == 0)


def tree_mm(a: torch.Tensor, b: torch.Tensor, groups: int, tiles=None, fuse: int | None = None,
            spill: bool | None = None) -> torch.Tensor:
    """fp32 [M, N]: the balanced tree over `groups` equal K ranges of a [M, K] @ b [K, N]
    (16-bit operands: their products are exact in fp32; each group summed in fp32).

    The per-tile kernel below runs by default. fuse: groups per K loop (1, or 2: each pair of
    groups from one loop); spill: the finished left pair parked in the output tile while the
    next one is summed. Neither
    changes a bit (the same dots, the same tree); the defaults are LOOPS[groups]. `tiles` is
    for the benchmark's sweep only: a 5-tuple (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for this
    kernel, or a TreeTiles for the persistent TMA kernel (tree_gemm_tma.py; Hopper+ or the
    interpreter, groups of whole BLOCK_K steps) - measured slower than this one on an H200 so
    far (docs/benchmarks.md). Another BLOCK_K is other bits."""
    if not supported(a, b, groups):
        raise ValueError(f"tree_mm: 16-bit a, b of one dtype and 1/2/4/8 groups dividing K; got "
                         f"{a.dtype}/{b.dtype}, K={a.shape[-1]}, groups={groups}")
    if tiles is not None and not isinstance(tiles, tuple):
        from tpdiag.kernels import tree_gemm_tma

        if not tree_gemm_tma.usable(a, groups, tiles):
            raise ValueError(f"tree_mm: tiles {tiles} do not fit K={a.shape[-1]} in {groups} groups "
                             "on this device")
        return tree_gemm_tma.tree_mm_tma(a, b, groups, tiles)
    kernel = _kernels()
    M, K = a.shape
    N = b.shape[1]
    kg = K // groups
    d_fuse, d_spill, d_tiles = LOOPS[groups] if LOOPS_ON[0] else (1, False, None)
    fuse = min(d_fuse if fuse is None else fuse, groups)
    spill = d_spill if spill is None else spill
    if fuse not in (1, 2):
        raise ValueError(f"tree_mm: fuse is 1 or 2 groups a loop, got {fuse}")
    if a.is_cuda:
        # BLOCK_M / BLOCK_N may differ by group count: a tile's bits do not depend on them (the
        # same BLOCK_K steps, the same dots; every variant checked bitwise against 128 x 64 at
        # every llama-1b shape by `python -m benchmarks tree-gemm`)
        bm, bn, bk, warps, stages = tiles or d_tiles or _CUDA_TILES[a.dtype]
        upcast = False
    else:
        bm, bn, bk, warps, stages = _INTERPRETER_TILES
        upcast = True
    c = alloc.empty(M, N, dtype=torch.float32, device=a.device)  # every tile stored
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    kernel[grid](a, b, c, M, N, kg, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                 c.stride(0), c.stride(1), GROUPS=groups, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 EVEN_K=kg % bk == 0, UPCAST=upcast, PAIRED=fuse == 2, SPILL=spill and fuse < groups,
                 num_warps=warps, num_stages=stages)
    return c


# groups a call -> (groups per K loop, spill, CUDA tiles or None for _CUDA_TILES), from `python
# -m benchmarks tree-gemm --loops` on one H100 (commits 65c233e and 9715f3e; docs/benchmarks.md).
# A step's calls at 4 groups (TP=2, G=8): a loop per group 78.2-91.0 ms, pairs 74.9-75.5, pairs
# at 128 x 128 with the left pair parked in the output tile 70.3-71.8 (cuBLAS 36.5-36.7);
# without the spill 128 x 128 holds three accumulators and spills registers (132-133). At 2
# groups (TP=4) a loop per group at 128 x 128 36.1 ms, one pair 37.0-37.4, 128 x 64 39.5-39.7
# (cuBLAS 19.3-20.0); at 1 group (TP=8) 128 x 128 20.5 ms, 128 x 64 22.2 (cuBLAS 11.7). Four
# groups a loop (tried at 65c233e, removed) did not fit in shared memory at 3 stages; at 2,
# 87.4-87.8 ms.
# Every variant the same bits as a loop per group at 128 x 64 at every llama-1b shape, and the
# subtrees compose across these per-count tiles (tests/test_tree_gemm.py on the H100). 8 groups
# (TP=1 at G=8): pairs at 128 x 64, not re-measured. TPDIAG_TREE_LOOPS=0: a loop per group
# everywhere at 128 x 64 (A/B).
_WIDE = (128, 128, 64, 8, 3)
LOOPS = {1: (1, False, _WIDE), 2: (1, False, _WIDE), 4: (2, True, _WIDE), 8: (2, False, None)}
LOOPS_ON = [os.environ.get("TPDIAG_TREE_LOOPS", os.environ.get("TPDIAG_TREE_PAIRED", "1")) != "0"]


def reference_tree_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 reference: what the tree approximates."""
    return a.double() @ b.double()
