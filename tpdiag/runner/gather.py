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
from tpdiag.base.gloo_release import settle
from tpdiag.kernels import alloc
from tpdiag.probes.hash_place import take_lanes
from tpdiag.probes.host_store import Captured
from tpdiag.probes.stream import as_tensor, finish
from tpdiag.runner.gather_hash import PIECE_ALIGN, StackLanes, stored_hash


def _stream_signature(metas: list[dict]) -> int:
    h = hashlib.sha256()
    for m in metas:
        h.update(f"{m['key']}|{m['dtype']}|{m['local_shape']}\n".encode())
    return int.from_bytes(h.digest()[:7], "little")


def _at_boundaries(records, lanes, device, group, world: int, ref_params=None, spmd: bool = False, hashbuf=None):
    """The streams with the records inside blocks whose ranks ran per-rank work (an expert-parallel
    MoE's own experts: runner/per_rank.py) left out, when that makes them the same on every rank;
    else Inconclusive, as before - or, where the streams were the same already (spmd), as they are."""
    from tpdiag.runner.per_rank import at_boundaries

    cut = at_boundaries(records, lanes, group, world, ref_params, _own_hashes(records, lanes, hashbuf))
    if cut is not None:
        kept, kept_lanes, _ = cut
        if _same_stream(kept, device, group, world):
            return kept, kept_lanes
    if spmd:
        return records, lanes
    raise Inconclusive("ranks recorded different event streams (different modules, shapes or "
                       "dtypes per rank); the model is not SPMD under this plan")


def _own_hashes(records, lanes, hashbuf) -> dict:
    """{position: this rank's hash of its tensor} for the hash-mode parameter and output records
    (their meta holds no hash: only lanes in the buffer). Under one name each rank may hold another
    expert, called on as many tokens on every rank: one shape everywhere, and only the bits tell its
    weights from a replica's and its output from a block's output every rank shares - which full
    capture's meta hash told and hash capture's did not (a false rank-inconsistent-replica BUG at
    init). One host read of those rows."""
    from tpdiag.kernels.hash_buffer import STALE
    from tpdiag.records.hashing import hash_of_lanes

    if hashbuf is None or lanes is None or len(lanes) != len(records):
        return {}
    at = [i for i, (m, t) in enumerate(records) if t is None and m.get("kind") in ("param_init", "out")
          and m.get("hash") is None and lanes[i] is not None]
    if not at:
        return {}
    ints, _ = take_lanes(hashbuf, [lanes[i] for i in at])
    out = {}
    for i, row in zip(at, ints.cpu().tolist()):
        if row[2] != STALE:  # changed in place before it was hashed: no evidence
            m = records[i][0]
            out[i] = hash_of_lanes(row[0], row[1], m["dtype"], m["local_shape"])
    return out


def _same_stream(records, device, group, world: int) -> bool:
    """Whether every rank recorded the same stream: the same records (key, shape, dtype) and bytes."""
    sig = torch.tensor([_stream_signature([m for m, _ in records]),
                        sum(_nbytes(t) for _, t in records if t is not None)], dtype=torch.int64, device=device)
    sigs = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(sigs, sig, group=group)
    settle([sig, *sigs], group)
    return all(torch.equal(s, sigs[0]) for s in sigs)


def _fill(dst: torch.Tensor, t, a: int, b: int, whole: dict) -> None:
    """Bytes [a, b) of a record's shard (a tensor, or one held on the host) into dst. whole: the
    last tensor record's flat bytes, kept for its next window."""
    if isinstance(t, Captured):
        t.store.read_into(t, a, b, dst)
        return
    if whole.get("t") is not t:
        whole.update(t=t, b=_as_bytes(t))
    dst.copy_(whole["b"][a:b])


def _as_bytes(t) -> torch.Tensor:
    t = as_tensor(t)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, Captured) else t.numel() * t.element_size()


def gather_records(records: list[tuple[dict, torch.Tensor | None]], device: torch.device,
                   group=None, lanes: list | None = None, hashbuf=None, *, stream: bool = False,
                   spill_dir: str | None = None, per_rank: dict | None = None):
    """Returns, on rank 0 of `group` (default: the world), [(meta, stored_tensor)] with
    meta['stored'] in {'single','stacked','hash'}; on other ranks None. Raises Inconclusive if
    the ranks recorded different streams. A hash-mode record (tensor None; lanes[i] its row of
    `hashbuf`) is stored as its whole-tensor hash and statistics, composed from every rank's
    share. A full-mode record's tensor may be held on the host (probes/host_store.Captured): it is
    gathered in windows of at most TPDIAG_GATHER_WINDOW bytes. stream=True: stored tensors
    are returned as Captured (host memory, spilled to spill_dir past the budget), not tensors.
    per_rank: the reference's parameter shapes (runner/per_rank.reference_params), given where the
    model holds parameters that are not one replica: its per-rank blocks are looked for even where
    every record has one shape on every rank."""
    finish(records)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if world == 1:
        hashed = _gather_lanes(records, lanes, hashbuf, device, group, 1, 0)
        out = []
        for m, t in records:
            if t is None:
                out.append((_hash_meta(m, hashed[m["idx"]], 1), None))
            else:
                out.append(({**m, "stored": "single", "ranks_equal": True, "world": 1},
                            t if stream else as_tensor(t)))
        return _with_stored_hash(out)

    spmd = _same_stream(records, device, group, world)
    if not spmd:
        from tpdiag.runner.missing_grads import fill_missing_grads

        filled = fill_missing_grads(records, lanes, group, world)
        if filled is not None and _same_stream(filled[0], device, group, world):
            (records, lanes), spmd = filled, True
    if per_rank or not spmd:
        records, lanes = _at_boundaries(records, lanes, device, group, world, per_rank, spmd=spmd, hashbuf=hashbuf)
    sizes = [_nbytes(t) for _, t in records if t is not None]
    hashed = _gather_lanes(records, lanes, hashbuf, device, group, world, rank)
    kept_all = [(m, t) for m, t in records if t is not None]
    # A record whose shard hashes the same on every rank is a replica: rank 0 keeps its own copy
    # and no byte moves (hash mode decides replicas the same way). At 4B that is the logits, the
    # largest record of a region pass, 0.6 GB a rank.
    same, differ = _same_on_every_rank(kept_all, device, group, world)
    moved = [i for i in range(len(kept_all)) if i not in same]
    kept = [kept_all[i] for i in moved]
    sizes = [sizes[i] for i in moved]
    per_record = {}  # rank 0: {position in kept: [per window, per rank byte pieces]}
    out_store = None
    if rank == 0 and stream:
        from tpdiag.probes.host_store import HostStore

        out_store = HostStore(torch.device("cpu"), spill_dir=spill_dir)
    stored = {}
    lanes_of_stack = StackLanes(kept, device, rank, world)
    whole = {}  # a tensor record's flat bytes, made once where it is not contiguous
    for window in _windows(sizes, window_bytes()):
        # each piece copied once, from where the record is held into the window (a record held on
        # the host was read whole, then concatenated, then moved: two more copies of every byte)
        buf = alloc.empty(sum(b - a for _, a, b in window), dtype=torch.uint8, device=device)
        off = 0
        for i, a, b in window:
            _fill(buf[off:off + b - a], kept[i][1], a, b, whole)
            # this rank's share of each stored hash, hashed where it lies now
            lanes_of_stack.add(i, buf[off:off + b - a], a)
            off += b - a
        # unfilled (deterministic mode's NaN fill): the gather writes each whole
        gathered = [alloc.empty_like(buf) for _ in range(world)] if rank == 0 else None
        if group is None:
            dist.gather(buf, gathered, dst=0)
        else:
            dist.gather(buf, gathered, group=group, group_dst=0)
        settle([buf, *(gathered or [])], group)
        if rank != 0:
            continue
        gathered = [g.cpu() for g in gathered]
        off = 0
        for i, a, b in window:
            per_record.setdefault(i, []).append([g[off:off + b - a] for g in gathered])
            off += b - a
            if b == sizes[i]:  # the record's last piece: decide what to store
                pieces = per_record.pop(i)
                stored[i] = _decide(kept[i][0], kept[i][1], pieces, world, out_store, stream,
                                    differ=moved[i] in differ)
    per_rank_lanes = lanes_of_stack.gather(group) if kept else []
    if rank != 0:
        return None
    for j, (meta, _) in stored.items():
        meta["stored_hash"] = stored_hash(meta, kept[j][1], per_rank_lanes[j])
    stored = {moved[j]: v for j, v in stored.items()}
    for i in same:
        stored[i] = _replica(*kept_all[i], world, stream)
    out, at = [], 0
    for m, t in records:
        if t is None:
            if hashed is not None:
                out.append((_hash_meta(m, hashed[m["idx"]], world), None))
            continue
        out.append(stored[at])
        at += 1
    return _with_stored_hash(out)


def _same_on_every_rank(kept, device, group, world: int) -> tuple[set[int], set[int]]:
    """(positions in `kept` whose shard hash (meta['hash'], made on the device when recorded)
    every rank shares, positions where every rank has one and they are not all equal - whose
    bytes then differ): one small all_gather. A record without a hash is in neither."""
    rank = dist.get_rank(group)
    if not kept:
        return set(), set()
    codes = []
    for m, _ in kept:
        h = m.get("hash")
        v = int(h, 16) if isinstance(h, str) else None
        # present flag, then the hash as a signed int64; a missing hash gets this rank's number,
        # so it matches on no two ranks
        codes.append([1, v - (1 << 64) if v >= 1 << 63 else v] if v is not None else [0, rank])
    mine = torch.tensor(codes, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    settle([mine, *every], group)
    every = torch.stack(every).cpu()
    present = (every[:, :, 0] == 1).all(0)
    ok = present & (every[:, :, 1] == every[0:1, :, 1]).all(0)
    return set(torch.nonzero(ok).flatten().tolist()), set(torch.nonzero(present & ~ok).flatten().tolist())


def _replica(m: dict, local, world: int, stream: bool):
    """A record every rank holds bit for bit (by its hash): rank 0's copy, stored once."""
    meta = {**m, "stored": "single", "ranks_equal": True, "world": world, "stored_hash": m["hash"]}
    if isinstance(local, Captured) and stream:
        return meta, local  # already on the host
    return meta, as_tensor(local).detach().cpu()


def window_bytes() -> int:
    import os

    from tpdiag.probes.host_budget import parse_bytes

    v = os.environ.get("TPDIAG_GATHER_WINDOW")
    return parse_bytes(v, "TPDIAG_GATHER_WINDOW") if v else 256 << 20


def _windows(sizes: list[int], limit: int):
    """[(record position, byte start, byte end)] per window of <= limit bytes; a record larger
    than a window is split over several. The same on every rank (the sizes are)."""
    window, used = [], 0
    for i, n in enumerate(sizes):
        a = 0
        while True:
            k = min(n - a, limit - used)
            if k < n - a:  # cut inside a record at whole elements of any dtype (gather_hash.py)
                k -= k % PIECE_ALIGN
                if k == 0 and window:
                    yield window
                    window, used = [], 0
                    continue
                k = k or min(n - a, PIECE_ALIGN)  # a window narrower than that: one piece past it
            window.append((i, a, a + k))
            used += k
            a += k
            if used >= limit:
                yield window
                window, used = [], 0
            if a >= n:
                break
    if window:
        yield window


def _decide(m: dict, local, pieces: list, world: int, out_store, stream: bool, differ: bool = False):
    """One record's stored form from every rank's bytes (pieces: per window, per rank); its
    stored hash is added by the caller (runner/gather_hash.py). differ: the ranks' hashes of
    their shards were not all equal, so neither are their bytes (not compared again)."""
    dtype, shape = local.dtype, local.shape
    if differ:
        equal = False
    else:
        shards_b = [torch.cat([p[r] for p in pieces]) if len(pieces) > 1 else pieces[0][r]
                    for r in range(world)]
        equal = all(torch.equal(shards_b[0], s) for s in shards_b[1:])
    if equal:
        meta = {**m, "stored": "single", "ranks_equal": True, "world": world}
        if isinstance(local, Captured) and stream:
            return meta, local  # rank 0's own shard, already on the host: not stored twice
        # clone: a slice of the byte buffer need not be aligned for the element type
        return meta, shards_b[0].clone().view(dtype).reshape(shape)
    meta = {**m, "stored": "stacked", "ranks_equal": False, "world": world}
    # the stack's bytes are the shards' one after another: copied once, where they are kept
    ordered = [p[r] for r in range(world) for p in pieces]
    if out_store is None:
        return meta, torch.cat(ordered).view(dtype).reshape(world, *shape)
    return meta, out_store.put_bytes(ordered, dtype, (world, *shape))


def _with_stored_hash(out):
    """The hash of exactly what goes to disk: RecordSet checks it on every read. A record
    stored as its rank's own shard already has that hash (meta['hash'], computed on the device
    when it was recorded): not recomputed on the host."""
    from tpdiag.records.hashing import tensor_hash

    res = []
    for m, t in out:
        exact = m.pop("_hash_is_tensor", False)  # a merged piece record: its hash is of t itself
        if t is None:
            res.append((m, t))
        elif "stored_hash" in m:
            res.append((m, t))
        elif (isinstance(t, Captured) or exact) and m.get("hash") and m["stored"] == "single":
            res.append(({**m, "stored_hash": m["hash"]}, t))
        else:
            res.append(({**m, "stored_hash": tensor_hash(as_tensor(t))}, t))
    return res


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
        settle([ints, floats, *(gi or []), *(gf or [])], group)
        if rank != 0:
            return None
    else:
        gi, gf = [ints], [floats]
    gi = [g.cpu().tolist() for g in gi]
    gf = [g.cpu().tolist() for g in gf]

    def share(i, f):  # take_lanes gives the lanes mod 2**32 already
        absmax = struct.unpack("<d", struct.pack("<q", i[3]))[0]  # float64 bits -> value
        return [i[0], i[1], i[2]], [f[0], f[1], absmax]

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

    if layout and layout.startswith("replicated:"):
        # each block's holders (probes/hash_place.py: neighbouring ranks) must hold the same lanes; the
        # whole is every block once. Copies that differ: each replica's whole hash (j-th holder of each)
        reps = int(layout.split(":")[2])
        groups = [range(b * reps, (b + 1) * reps) for b in range(len(shares) // reps)]
        copies = [compose([shares[g[j]] for g in groups], "sum") for j in range(reps)]
        ints, floats = copies[0]
        out["ranks_equal"] = all(shares[r][0] == shares[g[0]][0] for g in groups for r in g)
        if not out["ranks_equal"]:
            out["rank_hashes"] = [hash_of_lanes(c[0][0], c[0][1], m["dtype"], m["full_shape"]) for c in copies]
    elif layout and layout.startswith(("shard:", "strided:")):
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
