"""tree_mm (Triton interpreter): the rank's subtree root is the same node of the same tree at
every TP - the 8-group product equals the tree over the halves' 4-group products (TP=2) and the
quarters' 2-group products (TP=4), bitwise - and it is the tree of the per-group sums. Negative
control: one chain over the whole K (no groups) is other bits."""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # compiled on a GPU, interpreted elsewhere: the same kernel code either way
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tpdiag.kernels.tree import tree_sum_stacked  # noqa: E402
from tpdiag.kernels.tree_gemm import reference_tree_mm, tree_mm  # noqa: E402


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_mm_subtrees_compose(dtype, even):
    gen = torch.Generator().manual_seed(0)
    # M, N not tile multiples; groups of 24 = a masked tail in the interpreter's BLOCK_K 16, and
    # on a GPU (BLOCK_K 64) groups of 72
    kg = (128 if even else 72) if CUDA else (32 if even else 24)  # even: groups of whole BLOCK_Ks
    M, N, K = (300, 200, 8 * kg) if CUDA else (20, 24, 8 * kg)
    dev = "cuda" if CUDA else "cpu"
    a = (torch.randn(M, K, generator=gen) * 4).to(dtype).to(dev)
    b = torch.randn(K, N, generator=gen).to(dtype).to(dev)
    whole = tree_mm(a, b, 8)
    # a row's bits do not depend on M or on its position in a tile
    assert torch.equal(_bits(tree_mm(a[3:], b, 8)), _bits(whole[3:]))
    for tp in (2, 4):
        k = K // tp
        roots = torch.stack([tree_mm(a[:, r * k:(r + 1) * k], b[r * k:(r + 1) * k], 8 // tp)
                             for r in range(tp)])
        assert torch.equal(_bits(tree_sum_stacked(roots)), _bits(whole)), tp
    groups = torch.stack([tree_mm(a[:, g * kg:(g + 1) * kg], b[g * kg:(g + 1) * kg], 1)
                          for g in range(8)])
    assert torch.equal(_bits(tree_sum_stacked(groups)), _bits(whole))
    # a transposed (strided) operand gives the same bits: the fix passes w.t()
    assert torch.equal(_bits(tree_mm(a, b.t().contiguous().t(), 8)), _bits(whole))
    ref = reference_tree_mm(a.cpu(), b.cpu())
    assert ((whole.cpu().double() - ref).norm() / ref.norm()).item() < 1e-6
    # negative control: the same products summed as one chain over K
    assert not torch.equal(_bits(tree_mm(a, b, 1)), _bits(whole))


def test_fused_loops_and_spill_are_the_same_bits():
    """Each pair of groups from one loop (_pair_acc), with the left subtree
    parked in the output tile or not (spill), is the same tree of the same group sums as a loop
    per group, bit for bit - even and masked groups, 1 to 8 groups; and it is still a tree
    (negative control: one chain over K differs)."""
    gen = torch.Generator().manual_seed(2)
    dev = "cuda" if CUDA else "cpu"
    for kg in ((128, 72) if CUDA else (32, 24)):
        for groups in (1, 2, 4, 8):
            M, N, K = (300, 200, groups * kg) if CUDA else (20, 24, groups * kg)
            a = (torch.randn(M, K, generator=gen) * 4).to(torch.bfloat16).to(dev)
            b = torch.randn(K, N, generator=gen).to(torch.bfloat16).to(dev)
            one = tree_mm(a, b, groups, fuse=1, tiles=(128, 64, 64, 8, 3))
            # the shipped loops and tiles for this group count, and others (tiles are ignored
            # by the interpreter; on a GPU each must fit its shared memory)
            combos = [(None, None, None), (2, False, (128, 64, 64, 8, 3)), (2, True, (128, 64, 64, 8, 3)),
                      (2, True, (128, 128, 64, 8, 3)), (1, False, (128, 128, 64, 8, 3))]
            if not CUDA:  # the interpreter ignores tiles: each loop structure once
                combos = [c for i, c in enumerate(combos) if c[:2] not in [d[:2] for d in combos[:i]]]
            for fuse, spill, tiles in combos:
                got = tree_mm(a, b, groups, fuse=fuse, spill=spill, tiles=tiles)
                assert torch.equal(_bits(got), _bits(one)), (kg, groups, fuse, spill, tiles)
            if groups > 1:
                assert not torch.equal(_bits(tree_mm(a, b, 1)), _bits(one))


@pytest.mark.parametrize("subtile,nested_if", [(True, False), (False, False), (True, True)])
def test_tree_mm_tma_launches_compose(subtile, nested_if):
    """The persistent TMA kernel (opt-in: tiles=TreeTiles) holds two groups per launch: four are two launches (the second adds the
    first's root in its epilogue, stored whole or in two halves), eight two halves added. Each
    rank's root is still the same node of the same tree at TP=2/4/8, and a row's bits do not
    depend on M; a transposed weight (w.t()) is the same bits."""
    import dataclasses

    from tpdiag.kernels import tree_gemm_tma

    gen = torch.Generator().manual_seed(1)
    kg = 128 if CUDA else 32
    M, N, K = (300, 200, 8 * kg) if CUDA else (20, 24, 8 * kg)
    dev = "cuda" if CUDA else "cpu"
    a = (torch.randn(M, K, generator=gen) * 4).to(torch.bfloat16).to(dev)
    w = torch.randn(N, K, generator=gen).to(torch.bfloat16).to(dev)
    tiles = dataclasses.replace(tree_gemm_tma.tiles_for(a), epilogue_subtile=subtile,
                                nested_if=nested_if)
    whole = tree_mm(a, w.t(), 8, tiles=tiles)
    assert torch.equal(_bits(whole), _bits(tree_mm(a, w.t().contiguous(), 8, tiles=tiles)))
    for tp in (2, 4, 8):
        k = K // tp
        roots = torch.stack([tree_mm(a[:, r * k:(r + 1) * k], w.t()[r * k:(r + 1) * k], 8 // tp,
                                     tiles=tiles) for r in range(tp)])
        assert torch.equal(_bits(tree_sum_stacked(roots)), _bits(whole)), tp
    assert torch.equal(_bits(tree_mm(a[3:], w.t(), 8, tiles=tiles)), _bits(whole[3:]))
    ref = reference_tree_mm(a.cpu(), w.t().cpu())
    assert ((whole.cpu().double() - ref).norm() / ref.norm()).item() < 1e-6
    # the branch's two spellings are one arithmetic
    other = dataclasses.replace(tiles, nested_if=not nested_if)
    assert torch.equal(_bits(tree_mm(a, w.t(), 8, tiles=other)), _bits(whole))
