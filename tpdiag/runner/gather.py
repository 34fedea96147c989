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
from tpdiag.probes.recorder import take_lanes


def _stream_signature(metas: list[dict]) -> int:
    h = hashlib.sha256()
    for m in metas:
        h.update(f"{m['key']}|{m['dtype']}|{m['local_shape']}\n".encode())
    return int.from_bytes(h.digest()[:7], "little")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def gather_records(records: list[tuple[dict, torch.Tensor | None]], device: torch.device,
                   group=None, lanes: list | None = None, hashbuf=None):
    """Returns, on rank 0 of `group` (default: the world), [(meta, stored_tensor)] with
    meta['stored'] in {'single','stacked','hash'}; on other ranks None. Raises Inconclusive if
    the ranks recorded different streams. A hash-mode record (tensor None; lanes[i] its row of
    `hashbuf`) is stored as its whole-tensor hash and statistics, composed from every rank's
    share."""
    metas = [m for m, _ in records]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if world == 1:
        hashed = _gather_lanes(records, lanes, hashbuf, device, group, 1, 0)
        out = []
        for m, t in records:
            if t is None:
                out.append((_hash_meta(m, hashed[m["idx"]], 1), None))
            else:
                out.append(({**m, "stored": "single", "ranks_equal": True, "world": 1}, t))
        return _with_stored_hash(out)

    parts = [_as_bytes(t) for _, t in records if t is not None]
    sizes = [p.numel() for p in parts]
    total = sum(sizes)
    sig = torch.tensor([_stream_signature(metas), total], dtype=torch.int64, device=device)
    sigs = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(sigs, sig, group=group)
    if any(not torch.equal(s, sigs[0]) for s in sigs):
        raise Inconclusive("ranks recorded different event streams (different modules, shapes or "
                           "dtypes per rank); the model is not SPMD under this plan")
    hashed = _gather_lanes(records, lanes, hashbuf, device, group, world, rank)
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
    sizes = iter(sizes)
    for m, t in records:
        if t is None:
            if hashed is not None:
                out.append((_hash_meta(m, hashed[m["idx"]], world), None))
            continue
        n = next(sizes)
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
    from tpdiag.records.hashing import tensor_hash

    return [({**m, "stored_hash": tensor_hash(t)}, t) if t is not None else (m, t) for m, t in out]


def _gather_lanes(records, lanes, hashbuf, device, group, world, rank):
    """{idx: [(ints, floats) per rank]} on rank 0 for the hash-mode records (two collectives,
    one host sync); None elsewhere. ints = [lane_a, lane_b, nonfinite], floats = [sum, sumsq,
    absmax]."""
    import struct

    idxs = [m["idx"] for m, t in records if t is None]
    if not idxs:
        return {}
    ints, floats = take_lanes(hashbuf, [lanes[i] for i, (m, t) in enumerate(records) if t is None])
    ints, floats = ints.to(device), floats.to(device)
    if world > 1:
        gi = [torch.empty_like(ints) for _ in range(world)] if rank == 0 else None
        gf = [torch.empty_like(floats) for _ in range(world)] if rank == 0 else None
        kw = {"group": group, "group_dst": 0} if group is not None else {"dst": 0}
        dist.gather(ints, gi, **kw)
        dist.gather(floats, gf, **kw)
        if rank != 0:
            return None
    else:
        gi, gf = [ints], [floats]
    gi = [g.cpu().tolist() for g in gi]
    gf = [g.cpu().tolist() for g in gf]

    def share(i, f):
        absmax = struct.unpack("<d", struct.pack("<q", i[3]))[0]  # float64 bits -> value
        return [i[0] & 0xFFFFFFFF, i[1] & 0xFFFFFFFF, i[2]], [f[0], f[1], absmax]

    return {i: [share(gi[r][j], gf[r][j]) for r in range(len(gi))] for j, i in enumerate(idxs)}


def _hash_meta(m: dict, shares: list, world: int) -> dict:
    from tpdiag.kernels.hash_buffer import STALE
    from tpdiag.records.hashing import compose, hash_of_lanes

    layout = m.get("hash_layout")
    out = {**m, "stored": "hash", "world": world}
    if any(s[0][2] == STALE for s in shares):
        # changed in place between the record and its (queued) hash: no evidence either way
        out.update(hash_layout="stale", ranks_equal=None, full_hash=None)
        return out
    # the integer lanes cover every bit; the float sums (atomics) may differ in their last bits
    equal = all(s[0] == shares[0][0] for s in shares[1:])

    def per_rank(shape):
        return [hash_of_lanes(s[0][0], s[0][1], m["dtype"], shape) for s in shares]

    if layout and layout.startswith(("shard:", "strided:")):
        ints, floats = compose(shares, "sum")
        out["ranks_equal"] = None
    elif (layout or "").startswith("partial") or (layout == "unknown" and not equal):
        # an unreduced partial sum, or shards whose place in the whole tensor is unknown (no
        # reference shape): per-rank hashes only, nothing to compare
        out.update(ranks_equal=equal, full_hash=None, rank_hashes=per_rank(m["local_shape"]))
        return out
    else:
        ints, floats = compose(shares, "first")
        out["ranks_equal"] = equal
        if not equal:
            out["rank_hashes"] = per_rank(m["full_shape"])
    out["full_hash"] = hash_of_lanes(ints[0], ints[1], m["dtype"], m["full_shape"])
    out["stats"] = {"nonfinite": ints[2], "sum": floats[0], "sumsq": floats[1], "absmax": floats[2]}
    return out
