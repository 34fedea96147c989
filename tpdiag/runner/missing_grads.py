"""A parameter whose grad some ranks of a world never get: their streams lack its record.

A replicated parameter used on some ranks only (vLLM's row-parallel bias, added by rank 0 alone
before the all-reduce; a weight a rank's branch skips) gets a grad on those ranks and none on the
others - whose replicas then never move: a rank-inconsistent replica in the making, the user's
mistake. The ranks' record streams differ by those grads, which made the world inconclusive ("not
SPMD") and named nothing. Where the streams differ by such records ONLY, each rank that lacks one
records it as zeros (no grad is a zero step of that parameter) and the diff names the ranks' grads
as differing, where the mistake is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _sig(meta: dict) -> tuple:
    return meta["key"], meta["dtype"], tuple(meta["local_shape"])


def _kind(key: str) -> str | None:
    from tpdiag.records.keys import RecordKey

    try:
        return RecordKey.parse(key).kind
    except Exception:
        return None


def _subsequence(part: list, whole: list) -> bool:
    it = iter(whole)
    return all(any(s == w for w in it) for s in part)


def fill_missing_grads(records: list, lanes: list | None, group, world: int) -> tuple | None:
    """(records, lanes) with the parameter grads other ranks recorded and this rank did not: as
    zeros where every record holds its tensor (full capture); left out on every rank where hash
    capture holds lanes instead (no tensor to stand in: the replicas' step, recorded after, still
    shows them differ). None where the streams differ otherwise."""
    mine = [_sig(m) for m, _ in records]
    every: list = [None] * world
    dist.all_gather_object(every, mine, group=group)
    full = max(range(world), key=lambda r: len(every[r]))
    union = every[full]
    if len(set(union)) != len(union):
        return None
    need = set()
    for sigs in every:
        if not _subsequence(sigs, union):
            return None
        need |= set(union) - set(sigs)
    if not need or any(_kind(s[0]) != "param_grad" for s in need):
        return None
    if any(t is None for _, t in records):
        keep = [i for i, s in enumerate(mine) if s not in need]
        return [records[i] for i in keep], (None if lanes is None else [lanes[i] for i in keep])
    rank = dist.get_rank(group)
    metas = [{_sig(m): m for m, _ in records if _sig(m) in need} if rank == full else None]
    src = dist.get_global_rank(group, full) if group is not None else full
    dist.broadcast_object_list(metas, src=src, group=group)
    from tpdiag.records.hashing import tensor_hash

    device = next((t.device for _, t in records if isinstance(t, torch.Tensor)), torch.device("cpu"))
    own, have = iter(records), set(mine)
    out = []
    for s in union:
        if s not in have:
            m = dict(metas[0][s])
            t = torch.zeros(m["local_shape"], dtype=getattr(torch, m["dtype"]), device=device)
            if "hash" in m:
                m["hash"] = tensor_hash(t)
            out.append((m, t))
        else:
            out.append(next(own))
    for i, (m, _) in enumerate(out):
        m["idx"] = i  # execution order, the same on every rank now
    return out, lanes
