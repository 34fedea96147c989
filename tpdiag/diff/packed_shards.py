"""A weight cut by hand as packed blocks: each rank's plain shard holds its slice of every block.

transformers 5 keeps an MoE layer's experts as one `gate_up_proj` [E, 2I, H], gate rows stacked on
up rows. A user's style that keeps each rank's own intermediate columns keeps rows r of the gate
AND rows r of the up block (what `packed_colwise` does, a _StridedShard(split_factor=2) as DTensor
would mark it) - the only cut under which `chunk(2)` still pairs each gate row with its up row.
Its shards carry no placement, so the shape rule gathers them as one contiguous cut,
[g0; u0; g1; u1], which is not the reference's [g0; g1; u0; u1]: a correct plan read as a BUG at
init (`sharding-bug`, param_init).

The layout is learned where the bits are exact: the initial weights. A markerless shard whose
contiguous gather differs from the reference's weight but whose gather as s packed blocks equals it
bitwise is that layout, and the same parameter's grads and updated weights are gathered the same way
(records/layout.unstride). A cut that is neither (the naive contiguous cut of [gate; up]) keeps the
contiguous gather, which equals the reference at init; its forward shows the bug.
"""
from __future__ import annotations

import torch

from tpdiag.records.layout import Assembled, unstride

PARAM_KINDS = ("param_init", "param_grad", "param")
BLOCKS = (2, 3, 4)   # gate|up, q|k|v, and one more: the packings models use


class PackedShards:
    def __init__(self):
        self.blocks: dict[tuple, int] = {}

    def of(self, om: dict) -> int | None:
        return self.blocks.get((om.get("module"), om.get("name")))

    def regather(self, om: dict, ra: Assembled, oa: Assembled) -> Assembled:
        if om["kind"] not in PARAM_KINDS or om.get("placement") or oa.shards is None \
                or not oa.layout.startswith("shard:"):
            return oa
        d = int(oa.layout.split(":")[1])
        s = self.of(om)
        if s is None and om["kind"] == "param_init" and ra.full is not None and oa.full is not None \
                and ra.full.shape == oa.full.shape and not torch.equal(ra.full, oa.full):
            for k in BLOCKS:
                if oa.shards[0].shape[d] % k == 0 and torch.equal(unstride(oa.shards, d, k), ra.full):
                    s = self.blocks[(om.get("module"), om.get("name"))] = k
                    break
        if s is None:
            return oa
        return Assembled(unstride(oa.shards, d, s), oa.shards, f"strided:{d}:{s}", None)
