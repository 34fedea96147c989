"""Per-rank record stream: every tensor a probe sees, in execution order, as local shards.

A record is (meta, tensor). DTensors are stored as their local shard plus the placement, so
the gather step can rebuild the whole tensor without a collective inside a hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

PHASES = ("init", "forward", "loss", "backward", "optimizer")


def placement_label(t) -> str | None:
    """'shard:D', 'replicate' or 'partial' for a 1-D-mesh DTensor; None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    (p,) = t.placements[:1] or (None,)
    if p is None:
        return "replicate"
    if p.is_shard():
        return f"shard:{p.dim % t.ndim}"
    if p.is_partial():
        return "partial"
    return "replicate"


def local_of(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Recorder:
    step: int = 0
    phase: str = "init"
    records: list[tuple[dict, torch.Tensor]] = field(default_factory=list)
    _calls: dict = field(default_factory=dict)
    enabled: bool = True
    hash: bool = True
    stack: list = field(default_factory=list)  # modules whose forward is running (op attribution)

    def call_index(self, module: str) -> int:
        key = (self.step, self.phase, module)
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        return n

    def add(self, kind: str, module: str, name: str, t: torch.Tensor, *, call: int = 0,
            phase: str | None = None, layout: str | None = None, style: str | None = None,
            cls: str | None = None) -> dict | None:
        if not self.enabled or not isinstance(t, torch.Tensor):
            return None
        phase = phase or self.phase
        placement = layout if layout is not None else placement_label(t)
        local = local_of(t).detach()
        # A copy: later in-place updates (optimizer, inplace activations) must not rewrite history.
        local = local.clone(memory_format=torch.contiguous_format)
        meta = {
            "idx": len(self.records), "step": self.step, "phase": phase, "module": module,
            "kind": kind, "call": call, "name": name, "placement": placement, "style": style,
            "cls": cls,
            "dtype": str(local.dtype).replace("torch.", ""), "local_shape": list(local.shape),
        }
        meta["key"] = record_key(meta)
        if self.hash:
            from tpdiag.probes.hashing import tensor_hash

            meta["hash"] = tensor_hash(local)  # this rank's shard, computed on its device
        self.records.append((meta, local))
        return meta


def record_key(meta: dict) -> str:
    """Alignment key across degrees: same model, same step/phase/module/call/name."""
    return f"s{meta['step']}/{meta['phase']}/{meta['module']}/{meta['kind']}#{meta['call']}/{meta['name']}"
