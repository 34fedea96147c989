"""The stored hash of a gathered record, from lanes every rank computes on its own shard.

A record whose ranks hold different bits is stored as the stack [world, *local]: its flat bytes
are rank 0's shard, then rank 1's, ... The record hash's lanes are sums over elements by flat
position (kernels/record_hash.py), so the stack's lanes are the sum over ranks of each shard's
lanes taken at offset rank * numel - exact integers mod 2**32, in any order. Each rank hashes
its own bytes where the gather already put them (the window buffer, on its device: the Triton
kernel on CUDA, the torch/numpy path on the CPU) and rank 0 adds the lanes: the same hash as a
host pass over the stack (which rank 0 made alone while its peers waited: 2.3 s of a 10 s
region world at llama-1b 1 x 2048 on an H200), with no host pass. A record stored as rank 0's
shard (every rank's bytes equal) gets rank 0's own lanes at offset 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpdiag.base.gloo_release import settle

# A record split over gather windows is cut at multiples of this many bytes (runner/gather.py
# _windows), so that every piece holds whole elements of any dtype and hashes where it lies.
PIECE_ALIGN = 16


class StackLanes:
    """This rank's lanes of each gathered record, as placed in the stack (offset rank * numel),
    accumulated piece by piece on the device without a host sync."""

    def __init__(self, kept: list, device, rank: int, world: int):
        self.kept, self.rank, self.world = kept, rank, world
        self.acc = torch.zeros(len(kept), 2, dtype=torch.int64, device=device)
        # rank 0's shard sits at offset 0: its lanes are those of the hash made when it was
        # recorded, where that hash is of exactly these bytes (the condition _with_stored_hash
        # trusts it under) - read off it, not hashed again
        self.known = {}
        if rank == 0:
            from tpdiag.probes.host_store import Captured
            from tpdiag.records.hashing import lanes_of

            for i, (m, t) in enumerate(kept):
                if m.get("hash") and (isinstance(t, Captured) or m.get("_hash_is_tensor")):
                    lanes = lanes_of(m["hash"], str(t.dtype), tuple(t.shape))
                    self.known[i] = (lanes & 0xFFFFFFFF, lanes >> 32)

    def add(self, i: int, seg: torch.Tensor, start: int) -> None:
        """Bytes [start, start + len(seg)) of record i's shard, `seg` (uint8, on this rank's
        device), into its lanes."""
        if i in self.known or not seg.numel():
            return
        from tpdiag.kernels.record_hash import shard_lanes

        local = self.kept[i][1]
        es = local.element_size()
        if seg.data_ptr() % PIECE_ALIGN:
            seg = seg.clone()  # a slice of the window at an odd offset: aligned for the kernel
        n = local.numel()
        ints, _ = shard_lanes(seg.view(local.dtype), dim=0, full=self.world * n,
                              offset=self.offset(n, start, es), stats=False)
        self.acc[i] += ints[:2].to(self.acc.device)

    def offset(self, n: int, start: int, es: int) -> int:
        """The element where bytes `start` of this rank's n-element shard lie in the stack."""
        return self.rank * n + start // es

    def gather(self, group) -> list | None:
        """On rank 0, per record, [(lane_a, lane_b) per rank] (not yet reduced); None elsewhere."""
        kw = {"group": group, "group_dst": 0} if group is not None else {"dst": 0}
        every = [torch.empty_like(self.acc) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(self.acc, every, **kw)
        settle([self.acc, *(every or [])], group)
        if self.rank != 0:
            return None
        rows = torch.stack(every).cpu().tolist()  # [world][record][2]
        out = []
        for i in range(len(self.kept)):
            per = [tuple(rows[r][i]) for r in range(self.world)]
            if i in self.known:
                per[0] = self.known[i]
            out.append(per)
        return out


def stored_hash(meta: dict, local, per_rank: list) -> str:
    """The hash of what _decide stores for a record: the stack of every rank's shard, or rank 0's
    shard alone (meta['stored'] 'single')."""
    from tpdiag.records.hashing import M32, hash_of_lanes

    if meta["stored"] == "stacked":
        a, b = sum(p[0] for p in per_rank), sum(p[1] for p in per_rank)
        shape = (len(per_rank), *local.shape)
    else:
        (a, b), shape = per_rank[0], tuple(local.shape)
    return hash_of_lanes(a & M32, b & M32, str(local.dtype), shape)
