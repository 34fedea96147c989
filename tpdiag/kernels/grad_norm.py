"""TP-invariant global grad norm and clipping.

Every grad can be bitwise equal across TP and the global norm still differ: each rank sums
squares over its shard and the all-reduce adds shards in a TP-dependent order. Here each grad
is put back whole (an exact concatenation) on one rank, its owner, where its float64 norm is
taken by one reduction of the same shape at every TP; the owners' norms are shared exactly, the
per-grad norms combined in parameter order (Megatron's recipe plus the gather). The clip
coefficient is torch's, min(max_norm / (norm + 1e-6), 1), from that norm in torch's norm dtype:
one scalar, the same at every TP, and an elementwise multiply by it is the same per element at
any sharding - clipping stays the user's algorithm, only the norm is computed invariantly. The shards travel in
one collective per bucket of grads: ~150 grads of a 1B model gathered one by one cost ~30 ms of
host time per step on an H200 pair.
"""
from __future__ import annotations

import torch

from tpdiag.kernels import alloc


def _even_shard(g) -> tuple[int | None, int, torch.Tensor]:
    """(the dim an evenly sharded 1-D-mesh DTensor is split on, or None; its split factor; its
    local shard). A _StridedShard(d, sf) - transformers' packed gate/up expert weights - holds
    chunk r of each of sf blocks: gathered here like a Shard and put back in order by _whole,
    never through DTensor's redistribute (torch 2.11 cannot redistribute an sf=2 _StridedShard on
    a 1-D mesh: "use_strided_shard_as_shard_order is True, but placements ... is unable to be
    interpreted into a corresponding shard_order")."""
    local = g.to_local()
    if len(g.placements) != 1:
        return None, 1, local
    p = g.placements[0]
    sf = int(getattr(p, "split_factor", 1)) if type(p).__name__ == "_StridedShard" else 1
    if sf == 1 and not p.is_shard():
        return None, 1, local
    d = p.dim % g.ndim
    n = g.device_mesh.size()
    even = local.shape[d] * n == g.shape[d] and local.shape[d] % sf == 0
    return (d if even else None), sf, local


def _whole(per_rank: torch.Tensor, d: int, sf: int) -> torch.Tensor:
    """The whole tensor from every rank's piece [n, *local] along d: rank order for a Shard;
    for a _StridedShard, block by block, each block's chunks in rank order."""
    from tpdiag.kernels.tree import cat_stacked

    if sf == 1:
        return cat_stacked(per_rank, d)
    c = per_rank.shape[1 + d] // sf
    return torch.cat([cat_stacked(per_rank.narrow(1 + d, b * c, c), d) for b in range(sf)], d)


# Grads sent to their owners per bucket of this many local bytes: one collective per bucket
# instead of one per grad, and the whole tensors of one bucket alive at a time (peak memory
# stays bounded).
BUCKET_BYTES = 256 * 2**20


def grad_norm(params) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms: list = [None] * len(grads)
    sharded: dict = {}  # mesh -> (device, indices of the grads reduced by one owner)
    for i, g in _owned_wholes(grads, sharded):
        norms[i] = torch.linalg.vector_norm(g.detach(), dtype=torch.float64)
    _share(norms, sharded)
    return torch.linalg.vector_norm(torch.stack(norms))


# Each evenly sharded grad's norm is taken on ONE rank (its owner: the ranks' owned bytes kept
# level), which alone receives the other ranks' shards of it (an all-to-all per bucket) and
# reduces the whole tensor - the same reduction of the same shape as before, so the same bits;
# the owners' norms then reach every rank exactly (a sum of one value and zeros). Gathering
# every grad whole on every rank moved (TP-1)/TP of all the grads' bytes to each rank and
# reduced the whole model TP times (llama-1b bf16 at TP=2 on an H100: ~4 ms of all-gather and
# ~6 ms of copies of whole grads a step, docs/benchmarks.md).
def _owned_wholes(grads: list, sharded: dict):
    """Yield (index, whole grad) for the grads this rank reduces: every grad that is not an even
    1-D-mesh shard (replicated, uneven: whole everywhere, as before) and the sharded ones it
    owns; the sharded grads' indices go into sharded[mesh]."""
    from torch.distributed.tensor import DTensor

    # every grad reduced in its logical order: a rebuilt whole is contiguous, and the others are
    # made so (a float64 norm of a transposed grad runs in memory order: other bits than its
    # contiguous copy - the same parameter sharded at TP=2 and whole at TP=1 must agree)
    pending: dict = {}
    level: dict = {}
    for i, g in enumerate(grads):
        if not isinstance(g, DTensor):
            yield i, g.contiguous()
            continue
        d, sf, local = _even_shard(g)
        if d is None:
            yield i, g.full_tensor().contiguous()
            continue
        n = g.device_mesh.size()
        if n == 1:
            yield i, local.contiguous()
            continue
        loads = level.setdefault(g.device_mesh, [0] * n)
        owner = min(range(n), key=lambda r: (loads[r], r))
        loads[owner] += local.numel() * local.element_size()
        sharded.setdefault(g.device_mesh, (local.device, []))[1].append(i)
        key = (g.dtype, g.device_mesh)
        bucket = pending.setdefault(key, [0, []])
        bucket[1].append((i, (d, sf), local, owner))
        bucket[0] += local.numel() * local.element_size()
        if bucket[0] >= BUCKET_BYTES:
            yield from _to_owners(key[1], bucket[1])
            del pending[key]
    for (_, mesh), (_, items) in pending.items():
        yield from _to_owners(mesh, items)


def _to_owners(mesh, items):
    import torch.distributed as dist

    group = mesh.get_group()
    # the all-to-all's splits are in the group's rank order (as the old all-gather's pieces were)
    n, me = mesh.size(), dist.get_group_rank(group, dist.get_rank())
    # send: this rank's shards grouped by owner, in rank order (each group in the grads' order)
    send = [[t.reshape(-1) for _, _, t, o in items if o == r] for r in range(n)]
    in_splits = [sum(x.numel() for x in s) for s in send]
    flat = torch.cat([x for s in send for x in s]) if any(in_splits) else items[0][2].new_empty(0)
    mine = [(i, ds, t) for i, ds, t, o in items if o == me]
    width = sum(t.numel() for _, _, t in mine)  # even shards: the same from every rank
    recv = alloc.empty(n * width, dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(recv, flat, [width] * n, in_splits, group=group)
    del flat
    per_rank = recv.view(n, width)
    off = 0
    for i, (d, sf), t in mine:
        yield i, _whole(per_rank[:, off:off + t.numel()].reshape(n, *t.shape), d, sf)
        off += t.numel()


def _share(norms: list, sharded: dict) -> None:
    """Fill in the norms owned elsewhere: per mesh, one all-reduce of a float64 vector holding
    this rank's owned norms and zeros (x + 0 + ... + 0 = x exactly; NaN and inf stay)."""
    from tpdiag.base.gloo_release import all_reduce_settled

    for mesh, (device, idx) in sharded.items():
        zero = torch.zeros((), dtype=torch.float64, device=device)
        vec = torch.stack([norms[i] if norms[i] is not None else zero for i in idx])
        all_reduce_settled(vec, group=mesh.get_group())
        for k, i in enumerate(idx):
            norms[i] = vec[k]


def norm_dtype(grads: list) -> torch.dtype:
    """The dtype torch.nn.utils.clip_grad_norm_ computes the total norm (and so the clip
    coefficient) in: the grads' dtype, promoted over all of them (its per-grad norms are in each
    grad's dtype, stacked)."""
    dt = grads[0].dtype
    for g in grads[1:]:
        dt = torch.promote_types(dt, g.dtype)
    return dt


def clip_coefficient(total: torch.Tensor, max_norm: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch's clip coefficient, min(max_norm / (norm + 1e-6), 1), from the invariant float64 norm
    rounded to `dtype` (the dtype torch's own total norm has: norm_dtype): a 0-dim tensor on
    total's device, with no host sync (the host keeps queueing the optimizer's kernels while the
    GPU finishes the norm). Where that rounded norm equals torch's own, the coefficient - and so
    every scaled grad - is torch's bit for bit; a NaN norm gives NaN and an infinite one 0, as
    torch's. TP-invariant because the float64 norm is: the same scalar at every degree, and a
    multiply by one scalar gives the same bits per element at any sharding."""
    return torch.clamp(max_norm / (total.to(dtype) + 1e-6), max=1.0)


def scale_grads(grads: list, coef: torch.Tensor) -> None:
    """grads *= coef (a 0-dim tensor) on the local shards, one multi-tensor launch per dtype and
    device, as torch.nn.utils.clip_grad_norm_ does it (the coefficient in its own dtype: a
    16-bit grad times a float32 coefficient multiplies in float32 and rounds once; a DTensor's
    mul_ is its shard's)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for g in grads:
        local = g._local_tensor if isinstance(g, DTensor) else g
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), ts in groups.items():
        torch._foreach_mul_(ts, coef.to(device))


def grad_norm_and_clip(params, max_norm: float | None) -> torch.Tensor:
    # torch-function handling off: ~10 torch calls a grad, each of which every torch-function mode
    # a fix installs (invariant-attention's) would see first, and none acts on them
    with torch._C.DisableTorchFunction():
        return _norm_and_clip(list(params), max_norm)


def _norm_and_clip(params: list, max_norm: float | None) -> torch.Tensor:
    total = grad_norm(params)
    if max_norm is not None:
        clip_grads([p.grad for p in params if p.grad is not None], total, max_norm)
    return total


def clip_grads(grads: list, total: torch.Tensor, max_norm: float) -> None:
    """Scale the grads as `total`'s norm clips them: an invariant float64 total rounded to the
    grads' dtype first (torch's own norm dtype: norm_dtype), any other total (the stock float32
    norm) as it is - every clip of a step, stock or fixed, per-rank or not, by one rule."""
    if grads:
        dtype = norm_dtype(grads) if total.dtype == torch.float64 else total.dtype
        scale_grads(grads, clip_coefficient(total, max_norm, dtype))
