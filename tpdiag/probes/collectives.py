"""Hand-written in-place collectives, seen by the probes.

`torch.distributed.all_reduce(t)` and its in-place kin write `t` without bumping its version
counter (c10d's ops are not autograd in-place ops; torch 2.13). The recorder copies a tensor it
has recorded before only when its identity or version counters changed (probes/host_store.py, and
hash mode's `_hashed`), so a child module's partial sum, all-reduced in place by its parent,
was recorded again as the partial: the parent's output read as rank-inconsistent at op
granularity (the op probe had recorded the partial first) and consistent at module granularity.
While the probes are in, these functions are wrapped to make the recorder forget every tensor
they write, right after the call returns: no tensor, version counter or number changes.
Restored on exit.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

# function -> positions / keywords of the arguments it writes (tensors or lists of tensors)
_WRITES = {
    "all_reduce": ((0,), ("tensor",)), "broadcast": ((0,), ("tensor",)),
    "reduce": ((0,), ("tensor",)), "all_gather": ((0,), ("tensor_list",)),
    "all_gather_into_tensor": ((0,), ("output_tensor",)),
    "_all_gather_base": ((0,), ("output_tensor",)),
    "reduce_scatter": ((0,), ("output",)), "reduce_scatter_tensor": ((0,), ("output",)),
    "_reduce_scatter_base": ((0,), ("output",)),
    # torch >= 2.13's names for the single-tensor forms
    "all_gather_single": ((0,), ("output_tensor",)), "reduce_scatter_single": ((0,), ("output",)),
    "all_to_all": ((0,), ("output_tensor_list",)), "all_to_all_single": ((0,), ("output",)),
    "scatter": ((0,), ("tensor",)), "gather": ((1,), ("gather_list",)),
}


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


@contextmanager
def forget_written(rec):
    import torch.distributed as dist

    saved = {}
    try:
        for name, (pos, kws) in _WRITES.items():
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "_tpdiag_forget", False):
                continue

            def wrap(fn=fn, pos=pos, kws=kws):
                @functools.wraps(fn)
                def call(*args, **kwargs):
                    out = fn(*args, **kwargs)
                    for i in pos:
                        if i < len(args):
                            rec.forget(_tensors(args[i]))
                    for k in kws:
                        if k in kwargs:
                            rec.forget(_tensors(kwargs[k]))
                    return out

                call._tpdiag_forget = True
                return call

            saved[name] = fn
            setattr(dist, name, wrap())
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
