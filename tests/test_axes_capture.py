"""Hash capture of pieces at TP > 1: a micro-batch's or decode call's record can be a slice of the
whole along two dims (its piece and its TP shard). Its lanes take both offsets (probes/pieces.py:
the outer dim folds into the inner dim's offset, one row per index before the outer dim), so the
ranks' and pieces' lanes add up to the whole tensor's - what TP=1's single call hashes."""
import itertools

import torch

from tpdiag.kernels.record_hash import shard_lanes
from tpdiag.probes.pieces import _hash_placed


class _Rec:
    """The one Recorder method _hash_placed calls: a slot = the shard's (ints, floats) now."""

    def _hash(self, local, dim, full, offset, owner):
        return list(shard_lanes(local, dim, full, offset))  # a list: a tuple of slots is rows


def _lanes(slot):
    rows = slot if isinstance(slot, tuple) else (slot,)
    return [int(sum(int(r[0][i]) for r in rows)) & 0xFFFFFFFF for i in (0, 1)]


def _tiles(whole, piece_dim, n_pieces, tp_dim, world, offsets=None):
    """Every (piece, rank) tile of `whole`, hashed at its place; the lanes summed."""
    full = list(whole.shape)
    lp, ls = full[piece_dim] // n_pieces, full[tp_dim] // world
    total = [0, 0]
    for p, r in itertools.product(range(n_pieces), range(world)):
        op, os_ = (offsets or {}).get((p, r), (p * lp, r * ls))
        tile = whole.narrow(piece_dim, p * lp, lp).narrow(tp_dim, r * ls, ls)
        where, tp = (piece_dim, op, full[piece_dim]), (tp_dim, full[tp_dim], os_)
        got = _lanes(_hash_placed(_Rec(), tile, tile, full, where, tp))
        total = [(a + b) & 0xFFFFFFFF for a, b in zip(total, got)]
    return total


def test_piece_and_shard_lanes_add_up_to_the_whole_tensors():
    torch.manual_seed(0)
    for shape, piece_dim, tp_dim in (((3, 8, 6), 1, 2),   # decode: positions x column shard, batch 3
                                     ((4, 5, 6), 0, 2),   # micro-batch x column shard
                                     ((4, 6, 5), 0, 1),   # micro-batch x a middle dim
                                     ((2, 6, 8), 2, 1)):  # the shard dim outer of the piece dim
        for dtype in (torch.float32, torch.bfloat16):
            whole = torch.randn(shape).to(dtype)
            want = _lanes(list(shard_lanes(whole)))
            assert _tiles(whole, piece_dim, 2, tp_dim, 2) == want, (shape, piece_dim, tp_dim, dtype)
            # negative control: two tiles hashed at each other's places give other lanes
            lp, ls = shape[piece_dim] // 2, shape[tp_dim] // 2
            swapped = {(0, 0): (lp, 0), (1, 0): (0, 0)}
            assert _tiles(whole, piece_dim, 2, tp_dim, 2, swapped) != want


def test_a_piece_alone_or_a_shard_alone_is_one_dim():
    whole = torch.randn(2, 8, 4)
    full = list(whole.shape)
    want = _lanes(list(shard_lanes(whole)))
    halves = [whole[:, :4], whole[:, 4:]]
    assert [(a + b) & 0xFFFFFFFF for a, b in zip(
        _lanes(_hash_placed(_Rec(), halves[0], halves[0], full, (1, 0, 8), None)),
        _lanes(_hash_placed(_Rec(), halves[1], halves[1], full, None, (1, 8, 4))))] == want
