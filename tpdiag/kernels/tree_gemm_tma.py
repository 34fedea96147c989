"""tree_mm's persistent, TMA-fed kernel (Hopper+, and the Triton interpreter).

The same arithmetic contract as tree_gemm.py's first kernel - each K group summed into a fresh
fp32 accumulator in BLOCK_K steps upwards from the group's start, the groups combined in the
fixed pairing ((g0+g1)+(g2+g3))+... - but laid out for speed:

* one K loop per tile over all the rank's groups, so the software pipeline (TMA loads
  `num_stages` deep) runs straight across group boundaries; one loop per group drained and
  refilled the pipeline every KG / BLOCK_K steps (4 steps for llama-1b's wo at TP=2);
* at a group's last step the accumulator is folded into the tree's pending left children
  (a binary counter: at most log2(GROUPS) of them live) and restarted from zero, so the tree
  stays in registers and nothing but the rank's subtree root is stored;
* persistent programs (one per SM) walking tiles in the grouped order of invariant_gemm
  (GROUP_M row blocks share the B tiles in L2), TMA descriptors (no address registers; the
  register file holds the accumulators), the root stored through TMA.

The groups must be whole BLOCK_K steps (a TMA box past a group's end would read the next
group, not zeros): BLOCK_K is the largest of the config's choices dividing KG = K_global / G,
which is the same at every TP, so every degree runs the same instructions per group. Which
program computes a tile, and when, never changes what it computes; rows and columns past M / N
are zero-filled by TMA and clipped at the store, so a row's bits do not depend on M.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from tpdiag.kernels import gemm_common

triton = None
tl = None
_tile_coords = None
_store_tile = None


@dataclasses.dataclass(frozen=True)
class TreeTiles:
    block_m: int
    block_n: int
    block_k: tuple  # the BLOCK_K choices, largest first; the first dividing KG is used
    num_warps: int
    num_stages: int
    group_m: int = 8
    epilogue_subtile: bool = True  # store the fp32 root in two halves (less shared memory)
    # park: the tree's last pending left child (g0+g1 at 4 groups, g0..g3 at 8) waits in the
    # output tile in memory instead of registers (one register tile fewer; same adds, same bits)
    park: bool = False
    # nested: one K loop per group, the tree between them (no branch in the K loop, but the
    # pipeline drains at every group boundary); same sums, same bits
    nested: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def pick_k(self, kg: int) -> int | None:
        return next((bk for bk in self.block_k if kg % bk == 0), None)


# Chosen by the sweep in `python -m benchmarks tree-gemm` on an H200 (docs/benchmarks.md).
# Fixed per dtype (BLOCK_K also per KG, which is TP- and batch-invariant): other tiles, other bits.
CUDA_TILES = {
    torch.bfloat16: TreeTiles(128, 128, (64, 32, 16), 8, 4, group_m=8),
    torch.float16: TreeTiles(128, 128, (64, 32, 16), 8, 4, group_m=8),
}
INTERPRETER_TILES = TreeTiles(16, 16, (16,), 4, 1, group_m=2)
_INTERPRETER_NUM_SMS = 3


def _load_ab(a_desc, b_desc, off_m, off_n, off_k, A_T: tl.constexpr, B_T: tl.constexpr,
             UPCAST: tl.constexpr):
    if A_T:
        a = a_desc.load([off_k, off_m]).T
    else:
        a = a_desc.load([off_m, off_k])
    if B_T:
        b = b_desc.load([off_n, off_k]).T
    else:
        b = b_desc.load([off_k, off_n])
    if UPCAST:  # interpreter only: its dot mis-reads bf16 (as in invariant_gemm)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


def _group_sum(a_desc, b_desc, off_m, off_n, k0, steps, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
               UPCAST: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(steps):
        a, b = _load_ab(a_desc, b_desc, off_m, off_n, k0 + ki * BLOCK_K, A_T, B_T, UPCAST)
        acc = tl.dot(a, b, acc)
    return acc


def _tree_mm_nested_kernel(a_desc, b_desc, c_desc, M, N, KG,
                           GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                           A_T: tl.constexpr, B_T: tl.constexpr, UPCAST: tl.constexpr,
                           EPILOGUE_SUBTILE: tl.constexpr):
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    steps = KG // BLOCK_K
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        s = _group_sum(a_desc, b_desc, off_m, off_n, 0, steps, BLOCK_M, BLOCK_N, BLOCK_K,
                       A_T, B_T, UPCAST)
        if GROUPS >= 2:
            s = s + _group_sum(a_desc, b_desc, off_m, off_n, KG, steps, BLOCK_M, BLOCK_N,
                               BLOCK_K, A_T, B_T, UPCAST)
        if GROUPS >= 4:
            s23 = _group_sum(a_desc, b_desc, off_m, off_n, 2 * KG, steps, BLOCK_M, BLOCK_N,
                             BLOCK_K, A_T, B_T, UPCAST)
            s23 = s23 + _group_sum(a_desc, b_desc, off_m, off_n, 3 * KG, steps, BLOCK_M,
                                   BLOCK_N, BLOCK_K, A_T, B_T, UPCAST)
            s = s + s23
        if GROUPS == 8:
            s45 = _group_sum(a_desc, b_desc, off_m, off_n, 4 * KG, steps, BLOCK_M, BLOCK_N,
                             BLOCK_K, A_T, B_T, UPCAST)
            s45 = s45 + _group_sum(a_desc, b_desc, off_m, off_n, 5 * KG, steps, BLOCK_M,
                                   BLOCK_N, BLOCK_K, A_T, B_T, UPCAST)
            s67 = _group_sum(a_desc, b_desc, off_m, off_n, 6 * KG, steps, BLOCK_M, BLOCK_N,
                             BLOCK_K, A_T, B_T, UPCAST)
            s67 = s67 + _group_sum(a_desc, b_desc, off_m, off_n, 7 * KG, steps, BLOCK_M,
                                   BLOCK_N, BLOCK_K, A_T, B_T, UPCAST)
            s = s + (s45 + s67)
        _store_tile(c_desc, s, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


def _tree_mm_tma_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, M, N, KG,
                        GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                        A_T: tl.constexpr, B_T: tl.constexpr, UPCAST: tl.constexpr,
                        EPILOGUE_SUBTILE: tl.constexpr, PARK: tl.constexpr):
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    steps = KG // BLOCK_K
    k_tiles = steps * GROUPS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_cm = off_m + tl.arange(0, BLOCK_M)
        offs_cn = off_n + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :]
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # pending left children of the tree: l0 = a finished even group, l1 = a finished pair
        # (g0+g1 or g4+g5), l2 = the first four groups' sum
        l0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        l1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        l2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a, b = _load_ab(a_desc, b_desc, off_m, off_n, ki * BLOCK_K, A_T, B_T, UPCAST)
            acc = tl.dot(a, b, acc)
            # a group (not the last) ends here: fold it into the tree, restart from zero. The
            # last group stays in acc and is folded in after the loop.
            if GROUPS > 1:
                if (ki % steps == steps - 1) & (ki < k_tiles - 1):
                    g = ki // steps
                    if g % 2 == 0:
                        l0 = acc
                    else:
                        if GROUPS == 4:
                            if g == 1:
                                if PARK:
                                    tl.store(c_ptrs, l0 + acc, mask=c_mask)
                                else:
                                    l1 = l0 + acc
                        if GROUPS == 8:
                            if (g // 2) % 2 == 0:
                                l1 = l0 + acc
                            else:  # g == 3: the first four groups are done
                                if PARK:
                                    tl.store(c_ptrs, l1 + (l0 + acc), mask=c_mask)
                                else:
                                    l2 = l1 + (l0 + acc)
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the last group (odd) closes every pending level
        if GROUPS >= 2:
            acc = l0 + acc
        if GROUPS == 8:
            acc = l1 + acc
        if PARK & (GROUPS >= 4):
            # the parked left child, written by this program's threads: a CTA barrier makes
            # every thread's store visible to the thread that reads it back
            tl.debug_barrier()
            acc = tl.load(c_ptrs, mask=c_mask) + acc
            tl.store(c_ptrs, acc, mask=c_mask)
        else:
            if GROUPS == 4:
                acc = l1 + acc
            if GROUPS == 8:
                acc = l2 + acc
            _store_tile(c_desc, acc, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


@functools.lru_cache(maxsize=None)
def _kernel():
    global triton, tl, _tile_coords, _store_tile
    triton = gemm_common.import_triton()
    tl = triton.language
    _tile_coords, _store_tile = gemm_common._tile_coords, gemm_common._store_tile
    g = globals()
    for name in ("_load_ab", "_group_sum"):
        g[name] = triton.jit(getattr(g[name], "fn", g[name]))
    # M and N never specialised: one compiled kernel (one instruction stream) for every M, N
    return {name: triton.jit(getattr(g[name], "fn", g[name]), do_not_specialize=["M", "N"])
            for name in ("_tree_mm_tma_kernel", "_tree_mm_nested_kernel")}


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles_for(a: torch.Tensor) -> TreeTiles:
    return CUDA_TILES[a.dtype] if a.is_cuda else INTERPRETER_TILES


def usable(a: torch.Tensor, groups: int, tiles: TreeTiles) -> bool:
    """Hopper+ (TMA) or the interpreter, and groups of whole BLOCK_K steps."""
    if a.is_cuda and torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    return tiles.pick_k(a.shape[1] // groups) is not None


def _operand(t: torch.Tensor):
    from tpdiag.kernels.invariant_gemm import _tma_operand

    return _tma_operand(t)


def tree_mm_tma(a: torch.Tensor, b: torch.Tensor, groups: int, tiles: TreeTiles) -> torch.Tensor:
    """fp32 [M, N] subtree root of a [M, K] @ b [K, N] over `groups` equal K ranges (callers
    check supported() and usable())."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernels = _kernel()
    M, K = a.shape
    N = b.shape[1]
    kg = K // groups
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.pick_k(kg)
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    if M == 0 or N == 0:
        return c
    at, a_t = _operand(a)
    bt, b_t = _operand(b)
    ct = c if gemm_common._tma_ok(c) else gemm_common._padded_empty(M, N, torch.float32, a.device)
    a_desc = TensorDescriptor(at, list(at.shape), list(at.stride()), [bk, bm] if a_t else [bm, bk])
    b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [bn, bk] if b_t else [bk, bn])
    half = tiles.epilogue_subtile
    c_desc = TensorDescriptor(ct, list(ct.shape), list(ct.stride()), [bm, bn // 2 if half else bn])
    if a.is_cuda:
        num_sms = _num_sms(a.device.index if a.device.index is not None else torch.cuda.current_device())
    else:
        num_sms = _INTERPRETER_NUM_SMS
    grid = (min(num_sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    common = dict(GROUPS=groups, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m,
                  NUM_SMS=num_sms, A_T=a_t, B_T=b_t, UPCAST=not a.is_cuda, EPILOGUE_SUBTILE=half,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if tiles.nested:
        kernels["_tree_mm_nested_kernel"][grid](a_desc, b_desc, c_desc, M, N, kg, **common)
    else:
        kernels["_tree_mm_tma_kernel"][grid](a_desc, b_desc, c_desc, ct, ct.stride(0), M, N, kg,
                                             PARK=tiles.park, **common)
    if ct is not c:
        c.copy_(ct)
    return c
