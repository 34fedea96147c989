"""Deterministic all-reduce at a fixed TP degree.

NCCL picks ring or tree algorithms, channel counts and protocols at run time, so the same
all-reduce at the same TP can add its inputs in a different order from run to run. Here the
functional all-reduce that DTensor's Partial -> Replicate redistribution issues is replaced, for
sums of floating tensors, by an all-gather (exact) and a sum in rank order: one order, every run.
(It is NOT TP-invariant: the order still depends on how many ranks there are; tp-invariant-linear
removes the TP dependence for the reductions it owns.)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def _reduce_in_rank_order(parts: torch.Tensor, op: str) -> torch.Tensor:
    if op in ("max", "min"):
        return parts.amax(0) if op == "max" else parts.amin(0)
    out = parts[0].clone()
    for p in parts[1:]:
        out = out * p if op == "product" else out + p
    if op == "avg":
        out = out / parts.shape[0]
    return out


def _deterministic_all_reduce(tensor, reduce_op, group_name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    op = reduce_op.lower()
    if op not in ("sum", "avg", "max", "min", "product"):
        raise NotImplementedError(f"deterministic-collectives: reduce op {reduce_op!r}")
    n = _resolve_process_group(group_name).size()
    flat = tensor.contiguous().reshape(1, -1)
    g = torch.ops._c10d_functional.all_gather_into_tensor(flat, n, group_name)
    g = torch.ops._c10d_functional.wait_tensor(g)
    return _reduce_in_rank_order(g.reshape(n, -1), op).reshape(tensor.shape).to(tensor.dtype)


@contextmanager
def deterministic_all_reduce():
    """Override `_c10d_functional::all_reduce` for CPU and CUDA; the override is removed on exit."""
    import warnings

    lib = torch.library.Library("_c10d_functional", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
            for key in ("CPU", "CUDA"):
                lib.impl("all_reduce", _deterministic_all_reduce, key)
        yield
    finally:
        lib._destroy()
