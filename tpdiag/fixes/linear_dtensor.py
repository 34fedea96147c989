"""The fixed linears under torch's ParallelStyles: one autograd Function a call, on DTensors.

Why: a ParallelStyle's hooks hand the wrapper a DTensor input and take a DTensor output. Going
through to_local / from_local for x, the weight and y put three DTensor autograd Functions
around the fixed one on every call (three more backward nodes), each building a DTensorSpec:
at TP=4 on llama-1b the host, not the GPU, set the fixed step's pace (docs/benchmarks.md). Here
one Function takes the DTensors, runs the local Functions' own forward and backward
(kernels/grouped_linear.py, kernels/tree.py) on the same local tensors, and wraps its results
in specs built once per module the way from_local / to_local's backward build them. The same
kernels see the same tensors: the same bits; only the bookkeeping around them is gone.

The Functions' host code runs with torch-function handling off: every torch call in it went
through each torch-function mode a fix installs (invariant-attention's sees every call made while
it is on, ~1.3 us each on a 2-core CPU), and no mode acts on a linear's own ops.

Taken only where that bookkeeping moves no data: a plain local input tensor, no Partial
placement, no bias (linear.py keeps the general path for everything else).
"""
from __future__ import annotations

import copy
import weakref

import torch

from tpdiag.kernels.grouped_linear import ColLinear, RowLinearPartial, row_reduced


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def specs_of(mod) -> "Specs":
    """The module's Specs, kept while the module lives (the fixes are entered once per step)."""
    s = _SPECS.get(mod)
    if s is None:
        s = _SPECS[mod] = Specs()
    return s


class Specs:
    """One module's DTensorSpecs, keyed by what they are built from; a fresh copy per DTensor
    (as DTensor's own to_local backward does: a spec is never shared by two DTensors)."""

    def __init__(self):
        self._cache: dict = {}

    def out(self, local, mesh, placements):
        """DTensor.from_local(local, mesh, placements, run_check=False), without a graph node."""
        from torch.distributed.tensor import DTensor

        key = (mesh, placements, local.shape, local.stride(), local.dtype)
        spec = self._cache.get(key)
        if spec is None:
            spec = DTensor.from_local(local.detach(), mesh, placements, run_check=False)._spec
            self._cache[key] = spec
        return DTensor(local, copy.copy(spec), requires_grad=False)

    def grad(self, local, ref):
        """What to_local's backward hands on for a DTensor of spec `ref` whose local grad is
        `local` (no Partial in ref: its grad placements are ref's own)."""
        if local is None:
            return None
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_global_tensor_info

        key = ("grad", ref.mesh, ref.placements, ref.shape, local.shape, local.stride(), local.dtype)
        spec = self._cache.get(key)
        if spec is None:
            _, stride = compute_global_tensor_info(local, ref.mesh, ref.placements)
            spec = DTensor.from_local(local.detach(), ref.mesh, ref.placements, run_check=False,
                                      shape=ref.shape, stride=tuple(stride))._spec
            self._cache[key] = spec
        return DTensor(local, copy.copy(spec), requires_grad=False)


def usable(x) -> bool:
    """x: the DTensor the style's input hook made, holding a plain local tensor (not an async
    collective's result), with no Partial placement."""
    from torch.distributed.tensor import DTensor

    return (isinstance(x, DTensor) and type(x._local_tensor) is torch.Tensor
            and not any(p.is_partial() for p in x._spec.placements))


def _local_grad(g, mesh, placements):
    """from_local's backward: the grad's local tensor, redistributed to the forward's
    placements first when it arrives in others."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if tuple(g._spec.placements) != tuple(placements):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        target = DTensorSpec(mesh, tuple(placements), tensor_meta=g._spec.tensor_meta)
        local = redistribute_local_tensor(g._local_tensor, g._spec, target)
    else:
        local = g._local_tensor
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


class ColLinearD(torch.autograd.Function):
    """DTensor x (replicated), DTensor w (Shard(0)) -> DTensor y (Shard(-1)): ColLinear."""

    @staticmethod
    def forward(ctx, x, w, local_groups: int, blocked: bool, tree_dgrad: bool, site, specs):
        with torch._C.DisableTorchFunction():
            ctx.specs, ctx.x_spec, ctx.w_spec = specs, x._spec, w._spec
            y = ColLinear.forward(ctx, x._local_tensor, w._local_tensor, local_groups, blocked,
                                  tree_dgrad, site)
            ctx.y_placements = (_shard(y.dim() - 1),)
            return specs.out(y, w._spec.mesh, ctx.y_placements)

    @staticmethod
    def backward(ctx, g):
        with torch._C.DisableTorchFunction():
            dx, dw = ColLinear.backward(ctx, _local_grad(g, ctx.w_spec.mesh, ctx.y_placements))[:2]
            return (ctx.specs.grad(dx, ctx.x_spec), ctx.specs.grad(dw, ctx.w_spec),
                    None, None, None, None, None)


class RowLinearD(torch.autograd.Function):
    """DTensor x (Shard(-1)), DTensor w (Shard(1)) -> DTensor y (replicated):
    RowLinearPartial, then TreeAllReduce to x's dtype."""

    @staticmethod
    def forward(ctx, x, w, groups: int, site, specs):
        with torch._C.DisableTorchFunction():
            ctx.specs, ctx.x_spec, ctx.w_spec = specs, x._spec, w._spec
            y = row_reduced(ctx, x._local_tensor, w._local_tensor, groups, site)
            ctx.y_placements = (_replicate(),)
            return specs.out(y, w._spec.mesh, ctx.y_placements)

    @staticmethod
    def backward(ctx, g):
        with torch._C.DisableTorchFunction():
            # TreeAllReduce's backward would upcast the grad to the fp32 partial's dtype, and
            # RowLinearPartial's backward casts it back (tensor cores) or upcasts it anyway (CPU):
            # the 16-bit grad as it is gives the same bits without two [tokens, N] passes
            dx, dw = RowLinearPartial.backward(ctx, _local_grad(g, ctx.w_spec.mesh, ctx.y_placements))[:2]
            return (ctx.specs.grad(dx, ctx.x_spec), ctx.specs.grad(dw, ctx.w_spec),
                    None, None, None)


def _shard(d):
    from torch.distributed.tensor import Shard

    return Shard(d)


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()
