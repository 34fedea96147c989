"""A reduction order that does not depend on the TP degree.

The reduced dimension (K of a row-parallel GEMM, N of a column-parallel dgrad, the vocab of a
softmax) is cut into G fixed groups in GLOBAL coordinates (G = 8 by default: the largest TP
this supports). Each group is reduced by one call of identical shape at every TP - identical
shapes take identical kernel paths, so identical bits - and the G group results are summed in
fp32 by a balanced pairwise tree. At TP=T (a power of two dividing G) each rank holds G/T
adjacent groups, which form a subtree; the ranks' subtree roots are all-gathered and the tree
is finished in rank order. The sum is therefore the same tree at every TP: bitwise equal.

G is a run-level setting (tpdiag/fixes/groups.py chooses it: by default the largest degree a run
compares) that every rank of every world of the run installs in its process (a global, set for the
scope of `install_tree_groups`) before its fixes; a process that installs none reads
TPDIAG_TREE_GROUPS, else 8.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from tpdiag.errors import BadInput
from tpdiag.kernels import alloc


_INSTALLED: dict = {}  # {"groups": G, "per_group": bool} while install_tree_groups is active


def n_groups() -> int:
    g = _INSTALLED.get("groups")
    return g if g else int(os.environ.get("TPDIAG_TREE_GROUPS", "8"))


def gemm_per_group() -> bool:
    """True: a 16-bit group GEMM is one invariant GEMM call per group (fp32 out), at every
    degree - the run's largest degree holds one group per rank. False (no run setting, or G
    above every degree): a rank's groups in one fused tree_mm call. The two give other bits, so
    every world of a run takes the same one (fixes/groups.py)."""
    return bool(_INSTALLED.get("per_group"))


@contextmanager
def install_tree_groups(groups: int, per_group: bool = True):
    """Install the run's G (and its group GEMM) in this process; groups 0 installs nothing.
    A user training at TP=T with the fixes picks groups=T: one group per rank."""
    saved = dict(_INSTALLED)
    if groups:
        if groups < 1 or groups & (groups - 1):
            raise BadInput(f"tree groups {groups}: must be a power of two >= 1")
        _INSTALLED.update(groups=int(groups), per_group=bool(per_group))
    try:
        yield
    finally:
        _INSTALLED.clear()
        _INSTALLED.update(saved)


def check(dim: int, world: int, what: str) -> int:
    g = n_groups()
    if g & (g - 1) or world & (world - 1) or g % world:
        raise BadInput(f"{what}: the invariant reduction needs a power-of-two TP dividing "
                       f"the run's {g} tree groups (--tree-groups / TPDIAG_TREE_GROUPS); got TP={world}")
    if dim % g:
        raise BadInput(f"{what}: reduced dimension {dim} is not divisible by {g} groups")
    return g


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Balanced pairwise sum of a power-of-two list, adjacent pairs first."""
    n = len(parts)
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {n}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def tree_sum_stacked(t: torch.Tensor) -> torch.Tensor:
    """tree_sum of t's leading-dim slices (a power of two), one add per tree level: the same
    adjacent pairs, so the same bits as tree_sum(list(t))."""
    n = t.shape[0]
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {n}")
    while t.shape[0] > 1:
        t = t[0::2] + t[1::2]
    return t[0]


def tree_sum_stacked_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tree_sum_stacked(t).to(dtype), with the top add writing `dtype` directly: the add is
    done in t's dtype and rounded once on the store (one pass fewer over the result)."""
    n = t.shape[0]
    if n < 2 or n & (n - 1) or dtype == t.dtype:
        return tree_sum_stacked(t).to(dtype)
    while t.shape[0] > 2:
        t = t[0::2] + t[1::2]
    out = alloc.empty(t.shape[1:], dtype=dtype, device=t.device)
    return torch.add(t[0], t[1], out=out)


def all_gather_stacked(t: torch.Tensor) -> torch.Tensor:
    """[world, *t.shape]: every rank's t in rank order (one collective into one buffer, no
    per-rank copies out of it)."""
    w = world_size()
    out = alloc.empty(w * t.numel(), dtype=t.dtype, device=t.device)
    all_gather_flat(out, t.contiguous().reshape(-1), _group())
    return out.view(w, *t.shape)


def cat_stacked(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.cat(list(parts), dim) for rank parts [world, *shape]: rank r's shard becomes the
    r-th slice along `dim` (one copy; a view when dim is 0)."""
    n, shape = parts.shape[0], list(parts.shape[1:])
    d = dim % len(shape)
    return parts.movedim(0, d).reshape(*shape[:d], n * shape[d], *shape[d + 1:])


def all_gather_flat(out: torch.Tensor, flat: torch.Tensor, group) -> None:
    """Every rank's 1-D `flat`, concatenated in rank order into `out` (gloo takes only the
    concatenated form; torch 2.13 renamed the call)."""
    _collective("all_gather_single", "all_gather_into_tensor", out, flat, group)


def _collective(name: str, legacy: str, out: torch.Tensor, inp: torch.Tensor, group, wait: bool = True):
    """dist.<name>(out, inp, group=group) (torch < 2.13: dist.<legacy>), a sum where it reduces.

    While dist's function is torch's own (the probes wrap it: probes/collectives.py), the process
    group's method is called straight: the same collective, without the wrapper's Python checks
    and torch-function dispatch (every torch-function mode a fix installs sees the call first) -
    host time on every fixed linear, where the host sets the pace (TP=4, docs/benchmarks.md).
    wait=False: issued asynchronously, its Work returned (the process group's method only: see
    direct())."""
    from torch.distributed import distributed_c10d as c10d

    name, fn, own = _resolve(name, legacy)
    pg = group or c10d._get_default_group()
    method = getattr(pg, name, None)
    if not own or method is None or inp.is_complex():
        if not wait and own:  # torch < 2.13 has no process-group method of this name
            return fn(out, inp, group=group, async_op=True)
        fn(out, inp, group=group)
        return None
    if name == "all_to_all_single":
        opts = c10d.AllToAllOptions()
    elif "reduce" in name:
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = c10d.ReduceOp.SUM
    else:
        opts = c10d.AllgatherOptions()
    opts.asyncOp = not wait
    work = method(out, inp, [], [], opts) if name == "all_to_all_single" else method(out, inp, opts)
    if not wait:
        return work
    if work is not None:
        work.wait()
    return None


def _resolve(name: str, legacy: str):
    """(the name this torch has, dist's function of that name, whether it is torch's own: no
    probe wraps it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    fn = getattr(dist, name, None)
    if fn is None:
        name, fn = legacy, getattr(dist, legacy)
    return name, fn, fn is getattr(c10d, name, None)


def direct(name: str, legacy: str) -> bool:
    """Whether dist's function is torch's own, so that _collective(name, wait=False) hands back
    its Work."""
    import torch.distributed as dist

    return dist.is_initialized() and _resolve(name, legacy)[2]


def _group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


_LOCAL = [0]


@contextmanager
def local_only():
    """Compute as one rank: for tensors every rank already holds whole (replicated logits)."""
    _LOCAL[0] += 1
    try:
        yield
    finally:
        _LOCAL[0] -= 1


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() and not _LOCAL[0] else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() and not _LOCAL[0] else 0


def tree_reduce_scattered(part: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The top of the tree for every element, computed where it is owned.

    Elementwise, this is tree_sum_stacked(all_gather_stacked(part)) - the same adjacent pairs in
    rank order, so the same bits - but each rank sums only its 1/world of the elements: an
    all-to-all of fp32 slices (a fixed-order reduce-scatter), the rank's tree, one rounding to
    `out_dtype`, then an all-gather of the rounded result (at two ranks a reduce-scatter does the
    all-to-all and the add at once: see below). Bytes received per rank: (w-1)/w of the
    fp32 partial plus (w-1)/w of the result, instead of (w-1) whole fp32 partials - at TP=4 and a
    bf16 result 4.5 instead of 12 bytes per output element (a stock bf16 ring all-reduce: ~3).
    """
    w, group = world_size(), _group()
    out_dtype = out_dtype or part.dtype
    flat = part.contiguous().reshape(-1)
    n = flat.numel()
    chunk = -(-n // w)
    if chunk * w != n:
        flat = torch.nn.functional.pad(flat, (0, chunk * w - n))
    if w == 2:
        # Two ranks: the tree's top is one add, and IEEE addition commutes, so the collective's own
        # sum (each rank adds the other's chunk to its own, in the partial's dtype) is the tree's
        # bits - one reduce-scatter instead of an all-to-all and a separate pass for the add
        # (llama-1b bf16 8 x 4096 at TP=2 on H100: the add alone was ~13 ms a step). From three
        # ranks on, a collective's order is its own, so the all-to-all and our tree stay.
        summed = alloc.empty(chunk, dtype=flat.dtype, device=flat.device)
        # reduce_scatter_single (torch >= 2.13) is the same collective under its new name
        _collective("reduce_scatter_single", "reduce_scatter_tensor", summed, flat, group)
        mine = summed.to(out_dtype)  # the fp32 sum rounded once, as tree_sum_stacked_to does
    else:
        recv = alloc.empty_like(flat)
        _collective("all_to_all_single", "all_to_all_single", recv, flat, group)
        mine = tree_sum_stacked_to(recv.view(w, chunk), out_dtype)
    out = alloc.empty(w * chunk, dtype=out_dtype, device=part.device)
    all_gather_flat(out, mine, group)
    from tpdiag.kernels.shaped import shaped

    return shaped(out[:n], *part.shape)  # no view of the temporary: kernels/shaped.py


class TreeAllReduce(torch.autograd.Function):
    """Sum of every rank's subtree root, finished as the top of one tree (rank order), rounded
    once to `out_dtype` (default: the partial's dtype).

    Backward: d(sum)/d(part) = 1, and the incoming grad is replicated, so each rank's part
    simply receives it (upcast back to the partial's dtype: exact) - no communication, nothing
    reordered.
    """

    @staticmethod
    def forward(ctx, part: torch.Tensor, out_dtype=None) -> torch.Tensor:
        ctx.part_dtype = part.dtype
        return _all_reduce(part, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.part_dtype), None


def _all_reduce(part: torch.Tensor, out_dtype) -> torch.Tensor:
    if world_size() == 1:
        return part.to(out_dtype) if out_dtype not in (None, part.dtype) else part.clone()
    return tree_reduce_scattered(part, out_dtype)


def tree_all_reduce(part: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() and part.requires_grad:
        return TreeAllReduce.apply(part, out_dtype)
    return _all_reduce(part, out_dtype)  # no graph to record (a dgrad in backward): no Function


def reference_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """float64 reference for tests: what the tree approximates."""
    return torch.stack([p.to(torch.float64) for p in parts]).sum(0)
