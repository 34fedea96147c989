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
