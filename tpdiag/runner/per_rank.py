"""Per-rank work inside one module: compare at that module's boundary.

An expert-parallel MoE written the way Megatron-LM and DeepSpeed write it runs, on each rank, only
its own experts - submodules that are other experts per rank (`local_experts.0` is expert 0 on
rank 0 and expert 2 on rank 1), or are named by their global expert id (`experts.2` exists on rank
1 only) - on however many tokens the all-to-all sent them. Those records are not shards of one
tensor: no gather rebuilds TP=1's `local_experts.0` from them, and comparing them by name would
compare one expert against another. The block that holds them is SPMD again at its boundary (its
input and output are the same tensors on every rank, the all-to-all's combine having put every
token back), so that is where the world is compared: every record inside the block (its
submodules' records and the ops its own forward ran) is left out on every rank, the block's own
module records are kept, and the world says which block it compared at its boundary and why
(`per_rank` in world.json; the diff leaves the reference's records inside it out as well).

Where no such block exists (the per-rank records are not inside a module whose own records agree
on every rank) the world is as inconclusive as before: nothing here invents a comparison.
"""
from __future__ import annotations

import torch.distributed as dist

ROOT = "model"


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")


def _sig(m: dict) -> tuple:
    return (m["dtype"], tuple(m["local_shape"]))


def boundaries(per_rank: list[list[dict]], ref_params: dict | None = None) -> dict[str, list[str]] | None:
    """{block: [modules inside it whose records differ per rank]} from every rank's record metas
    (key, module, kind, dtype, local_shape; hash and placement of parameters and outputs), or None
    when some per-rank record is in no block whose own module records agree on every rank (or none
    differs at module level: an op stream that differs only in its ops is left to the caller).
    ref_params: the reference's parameter shapes by record key; a parameter with other bits per rank
    makes its module per-rank only where it is whole there (another expert per rank), not a shard
    of the reference's (a hand-sharded weight, which the gather rebuilds as before)."""
    maps = [{m["key"]: m for m in metas} for metas in per_rank]
    keys = set().union(*maps)
    differing = set()  # modules with a module-level record that is not the same on every rank
    for k in keys:
        ms = [mp.get(k) for mp in maps]
        m = next(x for x in ms if x is not None)
        if m["kind"] == "op":
            continue
        if any(x is None for x in ms) or len({_sig(x) for x in ms}) > 1:
            differing.add(m["module"])
        elif m["kind"] == "param_init" and None not in {x.get("hash") for x in ms} \
                and len({x.get("hash") for x in ms}) > 1 and ref_params is not None \
                and list(ref_params.get(k) or []) == list(m["local_shape"]):
            # other whole weights under one name per rank: another expert on each (the diff checks
            # that each is one of the reference's - diff/per_rank_weights.not_the_references - and says
            # so where one is not)
            differing.add(m["module"])
    if not differing:
        return None
    # a block's own module records are the same on every rank: one "out" of its forward at least,
    # and that output is one tensor - the same bits on every rank (every token back in place after
    # the combine) or a DTensor - not another expert's rows of one shape on each rank
    def whole(m):
        hs = [mp[m["key"]].get("hash") for mp in maps]
        return m.get("placement") is not None or None in hs or len(set(hs)) == 1

    spmd_out = {m["module"] for m in per_rank[0] if m["kind"] == "out" and m["phase"] == "forward"
                and m["module"] not in differing and all(m["key"] in mp for mp in maps[1:]) and whole(m)}
    blocks = {}
    for mod in sorted(differing):
        if mod == ROOT or "." not in mod:
            return None  # a top-level module (or the model itself) differs: no block holds it
        parent = mod
        while True:
            parent = parent.rpartition(".")[0]
            if not parent:
                return None
            if parent in spmd_out:
                break
        blocks.setdefault(parent, set()).add(mod)
    outer = {b: v for b, v in blocks.items() if not any(o != b and _inside(b, o) for o in blocks)}
    for b in blocks:
        if b not in outer:
            o = next(o for o in outer if _inside(b, o))
            outer[o] |= blocks[b] | {b}
    return {b: sorted(v) for b, v in sorted(outer.items())}


def _sharded(m: dict) -> bool:
    """A parameter record that is this rank's shard of one DTensor (cut by its placement): its bits
    differ per rank by construction, and the gather rebuilds the reference's whole from it - not
    another module per rank. (A hand-cut plain weight smaller than the reference's is not taken as
    one here: an expert-parallel block's `local_experts.0` cut by hand is another expert per rank.)"""
    return (m.get("placement") or "").startswith(("shard:", "strided:"))


def _per_rank_inside(every: list[list[dict]], blocks) -> set:
    """The modules inside the blocks whose records are not one module's on every rank: a module
    whose records differ per rank, or whose parameters do (`local_experts.1` can be called on as
    many tokens on both ranks and still be another expert on each), and every module above or
    below one inside its block. A module that is the same everywhere (the router, on each rank's
    share of the tokens) is kept: its records are shards or replicas like any other's - a
    column-parallel q_proj beside per-head norms cut per rank (each rank keeping its own heads'
    norms) holds other bits per rank because it is sharded, and stays compared as a shard (left
    out, its local shard was checked against the reference's whole weights: a false BUG)."""
    maps = [{m["key"]: m for m in metas} for metas in every]
    inside = {m["module"] for metas in every for m in metas
              if any(m["module"].startswith(b + ".") for b in blocks)}
    bad = set()
    for k in set().union(*maps):
        ms = [mp.get(k) for mp in maps]
        m = next(x for x in ms if x is not None)
        if m["module"] not in inside or m["kind"] == "op":
            continue
        if any(x is None for x in ms) or len({_sig(x) for x in ms}) > 1:
            bad.add(m["module"])
        elif m["kind"] == "param_init" and (ms[0].get("hash") is None or len({x.get("hash") for x in ms}) > 1) \
                and not all(_sharded(x) for x in ms):
            bad.add(m["module"])  # another expert's weights under one name (or no hash to tell)
    return {x for x in inside if any(x == y or x.startswith(y + ".") or y.startswith(x + ".") for y in bad)}


def _kept(m: dict, blocks, op_groups=(), drop=()) -> bool:
    mod = m["module"]
    if m["kind"] == "op" and ((m["phase"], mod) in op_groups or m["phase"] in op_groups):
        return False
    if mod in blocks:
        return m["kind"] != "op"  # the block's own ops ran on per-rank shapes
    return mod not in drop


def _op_groups(every: list[list[dict]], blocks, drop) -> set:
    """(phase, module) of the op streams outside the dropped modules that still differ per rank -
    the backward's ops, which autograd runs with no module to attribute them to, include the
    experts' backward. An op's key counts its occurrences in its stream, so after one op that
    differs the rest of that stream no longer lines up: the whole stream is left out, and the
    module records of that phase compare the same values. Where a left-out module has parameters,
    the optimizer's ops (one sequence per parameter, other parameters per rank) are left out too."""
    maps = [{m["key"]: m for m in metas if m["kind"] == "op" and _kept(m, blocks, drop=drop)} for metas in every]
    groups = set()
    for k in set().union(*maps):
        ms = [mp.get(k) for mp in maps]
        if any(x is None for x in ms) or len({_sig(x) for x in ms}) > 1:
            m = next(x for x in ms if x is not None)
            groups.add((m["phase"], m["module"]))
    if any(m["kind"] == "param_init" and m["module"] in drop for metas in every for m in metas) and any(
            m["kind"] == "op" and m["phase"] == "optimizer" for metas in every for m in metas):
        groups.add("optimizer")
    return groups


def _params_left_out(every: list[list[dict]], block: str, drop) -> dict:
    """{module.name: [its initial hash on each rank]} for the parameters left out inside `block`:
    the diff checks each is one of the reference's own (another expert's), not weights no TP=1
    module has."""
    out = {}
    for r, metas in enumerate(every):
        for m in metas:
            if m["kind"] == "param_init" and m["module"] in drop and m["module"].startswith(block + "."):
                out.setdefault(f"{m['module']}.{m['name']}", [None] * len(every))[r] = m.get("hash")
    return out


def reference_params(ref_dir: str) -> dict | None:
    """{record key: shape} of the reference's parameters, when it ran at TP=1 (else None)."""
    if not ref_dir:
        return None
    try:
        from tpdiag.records.store import read_index

        meta, events = read_index(ref_dir)
    except Exception:  # no readable reference: the parameter signal is not used
        return None
    if meta.get("degree") != 1:
        return None
    return {m["key"]: m["local_shape"] for m in events if m["kind"] == "param_init"}


def at_boundaries(records: list, lanes: list | None, group, world: int, ref_params: dict | None = None,
                  param_hashes: dict | None = None):
    """(records, lanes, {block: modules}) with every record inside a per-rank block left out on
    this rank, or None when the streams cannot be made the same that way (Inconclusive stays).
    param_hashes: {position: hash} of the parameter and output records whose meta has none (hash capture)."""
    hashes = param_hashes or {}
    mine = [{**{k: m.get(k) for k in ("key", "module", "kind", "phase", "dtype", "local_shape", "name")},
             **({"hash": m.get("hash") or hashes.get(i), "placement": m.get("placement")}
                if m.get("kind") in ("param_init", "out") else {})} for i, (m, _) in enumerate(records)]
    every = [None] * world
    # every rank decides from the same lists, so all take the same branch (and the same collectives)
    dist.all_gather_object(every, [lanes is None or len(lanes) == len(records), mine], group=group)
    if not all(ok for ok, _ in every):
        return None
    every = [metas for _, metas in every]
    blocks = boundaries(every, ref_params)
    if not blocks:
        return None
    drop = _per_rank_inside(every, blocks)
    ops = _op_groups(every, blocks, drop)
    # every rank keeps the same keys in the same order, or the comparison is off
    kept = [[m["key"] for m in metas if _kept(m, blocks, ops, drop)] for metas in every]
    if any(k != kept[0] for k in kept[1:]):
        return None
    # name what is left out: the outermost modules inside each block
    for b in blocks:
        inner = {x for x in drop if x.startswith(b + ".")}
        blocks[b] = sorted(x for x in inner if not any(x.startswith(y + ".") for y in inner))
    keep = [i for i, (m, _) in enumerate(records) if _kept(m, blocks, ops, drop)]
    out = []
    for i in keep:
        m, t = records[i]
        if m["module"] in blocks:  # a copy: the caller may still go on with the records as they were
            m = {**m, "per_rank_inside": blocks[m["module"]]}
            if ops:
                m["per_rank_ops"] = sorted(g if isinstance(g, str) else f"{g[0]}: {g[1]}" for g in ops)
            params = _params_left_out(every, m["module"], drop)
            if params:
                m["per_rank_params"] = params
        out.append((m, t))
    return out, [lanes[i] for i in keep] if lanes is not None else None, blocks


PER_RANK = "_tpdiag_per_rank"
PER_RANK_COPY = "_tpdiag_per_rank_copy"


def mark_params(model, world: int) -> int:
    """Mark the plain (not DTensor) parameters that are not one replica on every rank - a name some
    rank lacks (experts keyed by global id), or other bits under one name (`local_experts.0` is
    another expert per rank) - so the step's grad norm counts each rank's own (update.py), as
    Megatron's expert-parallel norm does, instead of taking one rank's copy for all. Returns how
    many names were marked on any rank (the same number on every rank). A per-rank parameter whose
    bits a lower rank holds too is a copy (PER_RANK_COPY): the norm counts it on that rank only."""
    from torch.distributed.tensor import DTensor

    from tpdiag.records.hashing import tensor_hash

    plain = [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    mine = {n: (tuple(p.shape), str(p.dtype), tensor_hash(p)) for n, p in plain}
    every = [None] * world
    dist.all_gather_object(every, mine)
    me = dist.get_rank()
    for n, p in plain:
        if any(e.get(n) != mine[n] for e in every):
            setattr(p, PER_RANK, True)
            # a lower rank holds the same bits: one block replicated on several ranks (a KV head
            # where TP exceeds their count) - counted once, on the first rank holding it
            setattr(p, PER_RANK_COPY, any(e.get(n) == mine[n] for e in every[:me]))
    # the count every rank computes alike (names marked on any rank): it decides collectives
    # (update.py's norm over the ranks), so a rank with none of its own marked must still join
    return sum(1 for n in set().union(*every) if len({repr(e.get(n)) for e in every}) > 1)


def norm_over_ranks(params, norm_fn, max_norm):
    """The grad norm when some parameters are per-rank (mark_params): the replicas' norm and the
    per-rank ones' squared norm summed over the ranks, then clipped as norm_fn itself clips: the
    stock norm (float32) from its total as it is, the invariant-grad-norm fix's (float64) from its
    total rounded to the grads' dtype first - the coefficient the reference's own norm_fn uses
    where no parameter is per-rank (a float64 coefficient rounds once more on its way into the
    grads' multiply and can differ from it by an ulp: a false difference in every update)."""
    import torch

    own = [p for p in params if getattr(p, PER_RANK, False) and not getattr(p, PER_RANK_COPY, False)]
    shared = [p for p in params if not getattr(p, PER_RANK, False)]
    dev = params[0].device  # an empty list's norm is a CPU zero: the all-reduce needs the device
    # in norm_fn's own dtype: the invariant-grad-norm fix's norm is float64, the reference's too
    a = norm_fn(shared, None).to(device=dev)
    b = norm_fn(own, None).to(device=dev, dtype=a.dtype) ** 2
    dist.all_reduce(b)
    total = torch.sqrt(a * a + b)
    if max_norm is not None:
        from tpdiag.kernels.grad_norm import clip_grads

        clip_grads([p.grad for p in params if p.grad is not None], total, max_norm)
    return total
