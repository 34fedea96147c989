"""DTensor helpers shared by probes and fixes (neither may import the other)."""
from __future__ import annotations

import torch

_DTENSOR: list = []


def _dtensor_cls():
    # cached: an import statement per record is measurable host time on a ~1000-record step
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    if type(t) is torch.Tensor:
        return t
    return t.to_local() if isinstance(t, _dtensor_cls()) else t


def placement_label(t) -> str | None:
    """The layout label of a 1-D-mesh DTensor ('shard:D', 'strided:D:S', 'replicate', 'partial'
    or 'partial:OP'); None for a plain tensor. A placement tpdiag cannot gather is an error:
    reading it as a replica would take one rank's piece for the whole tensor."""
    if type(t) is torch.Tensor or not isinstance(t, _dtensor_cls()):
        return None
    (p,) = t.placements[:1] or (None,)
    if p is None:
        return "replicate"
    return label_of_placement(p, t.ndim)


_PLACEMENTS: list = []


def label_of_placement(p, ndim: int) -> str:
    if not _PLACEMENTS:  # cached, as _dtensor_cls
        from torch.distributed.tensor import placement_types as pt

        _PLACEMENTS.extend((pt.Partial, pt.Replicate, pt.Shard, pt._StridedShard))
    Partial, Replicate, Shard, _StridedShard = _PLACEMENTS
    if isinstance(p, _StridedShard):
        # is_shard() is False for it (torch 2.13): transformers' packed_colwise expert weights
        s = int(p.split_factor)
        return f"shard:{p.dim % ndim}" if s == 1 else f"strided:{p.dim % ndim}:{s}"
    if type(p) is Shard:
        return f"shard:{p.dim % ndim}"
    if isinstance(p, Partial):
        op = str(getattr(p, "reduce_op", "sum"))
        return "partial" if op == "sum" else f"partial:{op}"
    if type(p) is Replicate:
        return "replicate"
    from tpdiag.errors import UnsupportedLayout

    raise UnsupportedLayout(f"DTensor placement {p!r} ({type(p).__name__}) is not one tpdiag can "
                            "gather (known: Shard, _StridedShard, Replicate, Partial)")
