"""tree_mm's persistent, TMA-fed kernel (Hopper+, and the Triton interpreter); opt-in (see CUDA_TILES).

The same arithmetic contract as tree_gemm.py's first kernel - each K group summed into a fresh
fp32 accumulator in BLOCK_K steps upwards from the group's start, the groups combined in the
fixed pairing ((g0+g1)+(g2+g3))+... - but laid out for speed:

* one K loop per tile over a launch's groups, so the software pipeline (TMA loads
  `num_stages` deep) runs straight across the group boundary; one loop per group drained and
  refilled the pipeline every KG / BLOCK_K steps (4 steps for llama-1b's wo at TP=2);
* at most two groups per launch: at the first group's last step the accumulator is kept and
  restarted from zero, and the two are added before the store - two fp32 register tiles. A
  third (the pending g0+g1 while g2 and g3 run) spills at 128x128 and cost 8x cuBLAS on an H200
  (kept in registers, or parked in the output tile in memory: docs/benchmarks.md). Four groups
  are two launches, the second adding the first's root in its epilogue; eight, two such
  halves added elementwise - the same nodes of the same tree, so the same bits;
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

from tpdiag.kernels import alloc, gemm_common

triton = None
tl = None
_tile_coords = None
_store_tile = None
_load_ab = None


@dataclasses.dataclass(frozen=True)
class TreeTiles:
    block_m: int
    block_n: int
    block_k: tuple  # the BLOCK_K choices, largest first; the first dividing KG is used
    num_warps: int
    num_stages: int
    group_m: int = 8
    epilogue_subtile: bool = True  # store the fp32 root in two halves (less shared memory)
    # the group-boundary branch written as in commit 35be229 (a compound condition, the kept
    # group assigned one `if` deeper): that form ran 1.2-1.6x faster at 2 groups on an H200
    # (docs/benchmarks.md). Same sums, same bits; not yet measured in this launch scheme.
    nested_if: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def pick_k(self, kg: int) -> int | None:
        return next((bk for bk in self.block_k if kg % bk == 0), None)


# The config of the full `python -m benchmarks tree-gemm` run on an H200 (docs/benchmarks.md;
# the sweep's best, an unsplit epilogue, was 7% faster), slower there than tree_gemm.py's
# per-tile kernel, so tree_mm runs this only when a caller passes tiles (benchmark, tests). A shipped config must stay fixed per dtype (BLOCK_K may follow
# KG, which is TP- and batch-invariant): other tiles, other bits.
CUDA_TILES = {
    torch.bfloat16: TreeTiles(128, 128, (64, 32, 16), 8, 4, group_m=8),
    torch.float16: TreeTiles(128, 128, (64, 32, 16), 8, 4, group_m=8),
}
INTERPRETER_TILES = TreeTiles(16, 16, (16,), 4, 1, group_m=2)
_INTERPRETER_NUM_SMS = 3


def _store_root(c_desc, acc, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EPILOGUE_SUBTILE: tl.constexpr, ADD: tl.constexpr):
    if ADD:
        # the left sibling's root is already in the output tile (an earlier launch): store
        # left + right, the tree's next node; the tile is read before this program writes it
        if EPILOGUE_SUBTILE:
            acc3 = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc3)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc0 = c_desc.load([off_m, off_n]) + acc0
            c_desc.store([off_m, off_n], acc0)
            acc1 = c_desc.load([off_m, off_n + BLOCK_N // 2]) + acc1
            c_desc.store([off_m, off_n + BLOCK_N // 2], acc1)
        else:
            acc = c_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N]) + acc
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc)
    else:
        _store_tile(c_desc, acc, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


def _tree_mm_tma_kernel(a_desc, b_desc, c_desc, M, N, KG,
                        GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                        A_T: tl.constexpr, B_T: tl.constexpr, UPCAST: tl.constexpr,
                        EPILOGUE_SUBTILE: tl.constexpr, ADD: tl.constexpr,
                        NESTED_IF: tl.constexpr):
    # GROUPS is 1 or 2: two fp32 tiles live at most (larger trees: tree_mm_tma composes launches)
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        l0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a, b = _load_ab(a_desc, b_desc, off_m, off_n, ki * BLOCK_K, A_T, B_T, UPCAST)
            acc = tl.dot(a, b, acc)
            if GROUPS == 2:
                if NESTED_IF:
                    if (ki % steps == steps - 1) & (ki < k_tiles - 1):
                        if ki // steps == 0:
                            l0 = acc
                        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                else:
                    if ki == steps - 1:  # the first group ends: keep it, restart from zero
                        l0 = acc
                        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GROUPS == 2:
            acc = l0 + acc
        _store_root(c_desc, acc, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE, ADD)


@functools.lru_cache(maxsize=None)
def _kernel():
    global triton, tl, _tile_coords, _store_tile, _load_ab
    triton = gemm_common.import_triton()
    tl = triton.language
    _tile_coords, _store_tile, _load_ab = gemm_common._tile_coords, gemm_common._store_tile, gemm_common._load_ab
    g = globals()
    for name in ("_store_root",):
        g[name] = triton.jit(getattr(g[name], "fn", g[name]))
    fn = g["_tree_mm_tma_kernel"]
    # M and N never specialised: one compiled kernel (one instruction stream) for every M, N
    return triton.jit(getattr(fn, "fn", fn), do_not_specialize=["M", "N"])


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
    check supported() and usable()).

    One launch holds at most two groups (two fp32 register tiles; a third spills at 128x128).
    Four groups: the left pair's root is stored, and the right pair's launch adds it in its
    epilogue (left + right: the tree's node, the same fp32 add the cross-rank tree would do);
    eight: the two halves' roots added elementwise. Same nodes, same bits at every TP."""
    M, K = a.shape
    N = b.shape[1]
    c = alloc.empty(M, N, dtype=torch.float32, device=a.device)  # every tile stored
    if not gemm_common._tma_ok(c):
        c = gemm_common._padded_empty(M, N, torch.float32, a.device)
    if M and N:
        _tree(a, b, groups, tiles, c)
    return c if c.is_contiguous() else c.contiguous()


def _tree(a, b, groups, tiles, c) -> None:
    if groups <= 2:
        _launch(a, b, groups, tiles, c, add=False)
        return
    h = a.shape[1] // 2
    _tree(a[:, :h], b[:h], groups // 2, tiles, c)
    if groups == 4:
        _launch(a[:, h:], b[h:], 2, tiles, c, add=True)
        return
    right = alloc.empty_like(c)
    _tree(a[:, h:], b[h:], groups // 2, tiles, right)
    c.add_(right)


def _launch(a, b, groups, tiles, c, add: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = _kernel()
    M, K = a.shape
    N = b.shape[1]
    kg = K // groups
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.pick_k(kg)
    at, a_t = _operand(a)
    bt, b_t = _operand(b)
    a_desc = TensorDescriptor(at, list(at.shape), list(at.stride()), [bk, bm] if a_t else [bm, bk])
    b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [bn, bk] if b_t else [bk, bn])
    half = tiles.epilogue_subtile
    c_desc = TensorDescriptor(c, list(c.shape), list(c.stride()), [bm, bn // 2 if half else bn])
    if a.is_cuda:
        num_sms = _num_sms(a.device.index if a.device.index is not None else torch.cuda.current_device())
    else:
        num_sms = _INTERPRETER_NUM_SMS
    grid = (min(num_sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    kernel[grid](a_desc, b_desc, c_desc, M, N, kg, GROUPS=groups, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=tiles.group_m, NUM_SMS=num_sms, A_T=a_t, B_T=b_t,
                 UPCAST=not a.is_cuda, EPILOGUE_SUBTILE=half, ADD=add, NESTED_IF=tiles.nested_if,
                 num_warps=tiles.num_warps, num_stages=tiles.num_stages)
