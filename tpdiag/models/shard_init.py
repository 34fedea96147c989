"""Materialise a model that was built AND sharded on the meta device, module by module, so that
no rank ever holds the whole model: at most one module's full tensors at a time.

The order is torchtitan's "meta init" order - build on meta, apply the TP plan on meta
(`parallelize_module` on meta parameters gives DTensors with meta local shards, and no
communication) - but the weights must be bitwise the ones the whole-model path gives
(tpdiag.models.meta_init.materialize, then a cast, then the plan): every degree and rank must
hold exactly its slice of TP=1's tensors. So each module, children before parents, gets its own
parameters and buffers as temporary FULL float32 tensors on the device (NaN-filled), the RNG is
reseeded from (seed, fqn) exactly as the whole path does, its init rule runs on them, they are
cast to the run dtype and cut to this rank's shard (`distribute_tensor(..., src_data_rank=None)`:
a local split, no communication - the same split transformers' styles make, and the same values
torch's styles scatter from rank 0, since every rank computed the same full tensor), and the full
tensors are dropped.

Why that is bitwise the whole path: each rule draws from its own seeded stream, so the order in
which modules are visited does not change a number; only the rules that write one tensor must
run in the same order on it. A tensor shared by several modules (tied embedding and LM head)
therefore makes those modules one unit: their rules run back to back (in post-order) on the one
full tensor, then it is sharded - the peak is one such unit, not one module. The cast is
elementwise and the split takes a slice, so cast-then-slice is slice-of-cast.

What it relies on: a rule writes only its own module's tensors (docs/models.md says so). A rule
that writes another module's tensor - one already sharded, or one still on meta (a write there
is lost) - is detected through the tensors' version counters and raised as
ShardedInitUnsupported, and the caller builds the whole model instead (the reason recorded).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from tpdiag.errors import BadInput
from tpdiag.models.meta_init import InitFn, _post_order, nan_like, stream_seed

# fill(original tensor, full tensor) -> whether it wrote it: what the rules left is overwritten
# (checkpoint weights)
FillFn = Callable[[torch.Tensor, torch.Tensor], bool]


class ShardedInitUnsupported(Exception):
    """This model cannot be materialised shard by shard; the message says why."""


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _versions(t) -> tuple:
    local = getattr(t, "_local_tensor", None)
    return (t._version, None if local is None else local._version)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _units(order, owners) -> list[list[int]]:
    """Module indices grouped into units: modules sharing a tensor are one unit, in post-order,
    each unit listed at its first module's position."""
    parent = list(range(len(order)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for _, occ in owners.values():
        first = find(occ[0][3])
        for *_, i in occ[1:]:
            r = find(i)
            if r != first:
                parent[max(r, first)] = min(r, first)
                first = min(r, first)
    groups: dict[int, list[int]] = {}
    for i in range(len(order)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def materialize_sharded(model: nn.Module, device, seed: int, init_module: InitFn, dtype,
                        fill: FillFn | None = None, context=nullcontext) -> dict:
    """Materialise the meta-built, meta-sharded `model` on `device` in `dtype` (see the module
    docstring): a torch.dtype for every floating tensor, or a rule fn(name, meta tensor) -> dtype
    (tpdiag.models.dtypes). `context()` is entered around the rules (transformers' init guard). Returns
    {'full_peak_bytes': most bytes of full (unsharded) tensors held at once, 'whole_bytes': the
    whole model's full tensors, 'unit_max_bytes': the largest unit's}. Raises BadInput naming a
    tensor no rule filled, ShardedInitUnsupported when a rule is not module-local."""
    DTensor = _dtensor()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    order = _post_order(model)
    owners: dict[int, tuple[torch.Tensor, list]] = {}  # id -> (tensor, [(module, slot, name, i)])
    names: dict[int, str] = {}
    for i, (fqn, mod) in enumerate(order):
        for slot in ("_parameters", "_buffers"):
            for name, t in getattr(mod, slot).items():
                if t is None:
                    continue
                owners.setdefault(id(t), (t, []))[1].append((mod, slot, name, i))
                names.setdefault(id(t), f"{fqn}.{name}" if fqn else name)
    start = {k: _versions(t) for k, (t, _) in owners.items()}
    whole = sum(_nbytes(t) for t, _ in owners.values())
    by_module: dict[int, list[int]] = {}
    for k, (_, occ) in owners.items():
        for *_, i in occ:
            if k not in by_module.setdefault(i, []):
                by_module[i].append(k)

    live = peak = unit_max = 0
    finished: list[tuple[str, torch.Tensor, tuple]] = []
    cuda = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad(), context():
        for unit in _units(order, owners):
            keys = list(dict.fromkeys(k for i in unit for k in by_module.get(i, [])))
            full, fresh = {}, set()
            for k in keys:
                t, occ = owners[k]
                if _versions(t) != start[k]:
                    raise ShardedInitUnsupported(
                        f"{names[k]} was written before its own module's init (a rule that "
                        "writes another module's tensor)")
                full[k], new_storage = _allocate(t, device, names[k])
                if new_storage:
                    fresh.add(k)
                for mod, slot, name, _ in occ:
                    getattr(mod, slot)[name] = full[k]
                live += _nbytes(full[k])
            peak = max(peak, live)
            unit_max = max(unit_max, sum(_nbytes(f) for f in full.values()))
            for i in unit:
                fqn, mod = order[i]
                s = stream_seed(seed, fqn)
                torch.default_generator.manual_seed(s)  # as meta_init.materialize: the device's below
                if cuda:
                    with torch.cuda.device(device):
                        torch.cuda.manual_seed(s)
                init_module(fqn, mod)
            for k in keys:
                t, occ = owners[k]
                new = _finish(t, occ, full[k], k in fresh, dtype, names[k], fill, DTensor)
                for mod, slot, name, _ in occ:
                    getattr(mod, slot)[name] = new
                finished.append((names[k], new, _versions(new)))
                live -= _nbytes(full[k])
            del full
    for name, t, v in finished:
        if _versions(t) != v:
            raise ShardedInitUnsupported(f"{name} was written after its own module's init (a rule "
                                         "that writes another module's tensor)")
    return {"full_peak_bytes": peak, "whole_bytes": whole, "unit_max_bytes": unit_max}


def _allocate(t, device, name: str) -> tuple[torch.Tensor, bool]:
    """(t's temporary full tensor on `device`, whether it is new storage): NaN-filled for a meta
    tensor (as the whole path, so the NaN check can name what no rule filled), a copy of a real
    one (not checked: the whole path moves those as they are)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None and not local.is_meta:
        raise ShardedInitUnsupported(f"{name} is a DTensor with real data before materialisation")
    fresh = local is not None or t.is_meta
    if fresh:
        data = nan_like(t, device)
    else:
        data = t.detach().to(device)
    if isinstance(t, nn.Parameter):
        data = nn.Parameter(data, requires_grad=t.requires_grad)
    return data, fresh


def _finish(t, occ, full, fresh: bool, dtype, name: str, fill, DTensor):
    """The full tensor after its rules: checked, filled from the checkpoint, cast, sharded like
    the meta tensor `t` (a DTensor's mesh and placements), as a Parameter if `t` was one, with
    the grad hooks registered on `t` carried over."""
    mod, slot, pname, _ = occ[-1]
    cur = getattr(mod, slot)[pname]
    if cur is not full:  # replaced by its rule (module.weight = ...): nothing left to fill
        if cur is None or cur.is_meta:
            raise BadInput(f"{name}: still on the meta device after initialisation")
        full = cur
        fresh = False
    data = full.detach()
    # a tensor the checkpoint holds needs no rule: Apertus' XIELU alpha_p/alpha_n are set in the
    # activation's __init__ (lost on meta) and no _init_weights fills them, but its checkpoint does
    loaded = fill is not None and fill(t, data)
    if fresh and not loaded and (full.is_floating_point() or full.is_complex()) \
            and bool(torch.isnan(full).any()):
        raise BadInput(f"{name}: not initialised by its module's init rule (a meta-built model "
                       "must have every parameter and buffer filled by its rule: "
                       "docs/models.md, 'Meta-device build')")
    if data.is_floating_point() or data.is_complex():
        # the run's dtype of this tensor (tpdiag.models.dtypes), before the split as the whole path
        want = dtype(name, t) if callable(dtype) else dtype
        if data.dtype != want:
            data = data.to(want)
    if isinstance(t, DTensor):
        from torch.distributed.tensor import distribute_tensor

        dt = distribute_tensor(data, t.device_mesh, t.placements, src_data_rank=None)
        local = dt.to_local()
        if local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() \
                and local.numel() < data.numel():
            local = local.clone()  # a view would keep the full storage alive
        data = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=dt.shape, stride=dt.stride())
    if isinstance(t, nn.Parameter):
        data = nn.Parameter(data, requires_grad=t.requires_grad)
        for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
            data.register_post_accumulate_grad_hook(hook)
        for hook in (getattr(t, "_backward_hooks", None) or {}).values():
            data.register_hook(hook)
    return data
