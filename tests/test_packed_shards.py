"""diff/packed_shards.py on records as a TP=2 world writes them (markerless stacked shards): the
layout of a hand-cut packed weight is learned from its init, bitwise, and kept for its grads."""
import torch

from tpdiag.diff.pair_assemble import assemble_pair
from tpdiag.diff.packed_shards import PackedShards


def _meta(kind, local, world, stored):
    return {"key": f"s0/x/m/{kind}#0/w", "module": "m", "name": "w", "kind": kind, "placement": None,
            "local_shape": local, "world": world, "stored": stored}


def _pair(kind, full, shards):
    rm, om = _meta(kind, list(full.shape), 1, "single"), _meta(kind, list(shards[0].shape), 2, "stacked")
    return rm, om, *assemble_pair(rm, full, om, torch.stack(shards))


def test_gate_up_cut_per_block_is_learned_at_init_and_kept_for_grads():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 4, generator=g)          # [E, 2I, H]: gate rows 0-3, up rows 4-7
    packed = [torch.cat([w[:, r * 2:(r + 1) * 2], w[:, 4 + r * 2:4 + (r + 1) * 2]], 1) for r in range(2)]
    rm, om, ra, oa = _pair("param_init", w, packed)
    assert not torch.equal(oa.full, w)             # the shape rule's contiguous gather: [g0; u0; g1; u1]
    p = PackedShards()
    assert torch.equal(p.regather(om, ra, oa).full, w)
    grad = torch.randn(3, 8, 4, generator=g)
    gshards = [torch.cat([grad[:, r * 2:(r + 1) * 2], grad[:, 4 + r * 2:4 + (r + 1) * 2]], 1) for r in range(2)]
    rm, om, ra, oa = _pair("param_grad", grad, gshards)
    got = p.regather(om, ra, oa)
    assert got.layout == "strided:1:2" and torch.equal(got.full, grad)


def test_a_contiguous_cut_and_a_wrong_weight_keep_the_shape_rule():
    w = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(1))
    p = PackedShards()
    rm, om, ra, oa = _pair("param_init", w, [w[:, :4], w[:, 4:]])
    assert p.regather(om, ra, oa) is oa and p.of(om) is None
    other = w.clone()
    other[0, 0, 0] += 1                            # not the reference's weight in any layout
    bad = [torch.cat([other[:, r * 2:(r + 1) * 2], other[:, 4 + r * 2:4 + (r + 1) * 2]], 1) for r in range(2)]
    rm, om, ra, oa = _pair("param_init", w, bad)
    assert p.regather(om, ra, oa) is oa and p.of(om) is None
