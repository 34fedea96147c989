"""Gather every rank's record stream to rank 0 in ONE collective, then decide what to store.

Shards are moved as raw bytes (uint8 views), so nothing is rounded or converted on the way.
A replicated tensor is stored once when every rank holds the same bits, else as a stack
[world, *local] - which is itself evidence (a rank-inconsistent replica or an unmarked shard).
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from tpdiag.errors import Inconclusive


def _stream_signature(metas: list[dict]) -> int:
    h = hashlib.sha256()
    for m in metas:
        h.update(f"{m['key']}|{m['dtype']}|{m['local_shape']}\n".encode())
    return int.from_bytes(h.digest()[:7], "little")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def gather_records(records: list[tuple[dict, torch.Tensor]], device: torch.device, group=None):
    """Returns, on rank 0 of `group` (default: the world), [(meta, stored_tensor)] with
    meta['stored'] in {'single','stacked'}; on other ranks None. Raises Inconclusive if the
    ranks recorded different streams."""
    metas = [m for m, _ in records]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if world == 1:
        out = []
        for m, t in records:
            out.append(({**m, "stored": "single", "ranks_equal": True, "world": 1}, t))
        return _with_stored_hash(out)

    parts = [_as_bytes(t) for _, t in records]
    sizes = [p.numel() for p in parts]
    total = sum(sizes)
    sig = torch.tensor([_stream_signature(metas), total], dtype=torch.int64, device=device)
    sigs = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(sigs, sig, group=group)
    if any(not torch.equal(s, sigs[0]) for s in sigs):
        raise Inconclusive("ranks recorded different event streams (different modules, shapes or "
                           "dtypes per rank); the model is not SPMD under this plan")
    buf = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(buf) for _ in range(world)] if rank == 0 else None
    if group is None:
        dist.gather(buf, gathered, dst=0)
    else:
        dist.gather(buf, gathered, group=group, group_dst=0)
    if rank != 0:
        return None
    gathered = [g.cpu() for g in gathered]
    out = []
    off = 0
    for (m, t), n in zip(records, sizes):
        shards_b = [g[off:off + n] for g in gathered]
        off += n
        equal = all(torch.equal(shards_b[0], s) for s in shards_b[1:])
        # clone: a slice of the byte buffer need not be aligned for the element type
        shards = [s.clone().view(t.dtype).reshape(t.shape) for s in shards_b]
        if equal:
            out.append(({**m, "stored": "single", "ranks_equal": True, "world": world}, shards[0].clone()))
        else:
            out.append(({**m, "stored": "stacked", "ranks_equal": False, "world": world},
                        torch.stack(shards)))
    return _with_stored_hash(out)


def _with_stored_hash(out):
    """The hash of exactly what goes to disk: RecordSet checks it on every read."""
    from tpdiag.probes.hashing import tensor_hash

    return [({**m, "stored_hash": tensor_hash(t)}, t) for m, t in out]
