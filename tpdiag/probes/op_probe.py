"""Per-op records: a TorchDispatchMode that records the output of every compute op.

Ops are attributed to the innermost module whose forward is running (forward), else to the
phase (loss, backward, optimizer), and named by op and occurrence within that module, so the
alignment survives extra ops at TP > 1 (collectives, redistributes): those are simply keys the
reference lacks. Under DTensor the mode sees DTensor-level ops (local shard + placement) and the
functional collectives that redistributions issue. It only observes: outputs are returned as is.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tpdiag.probes.recorder import Recorder

# Metadata and aliasing ops produce no new numbers; recording them only adds noise.
_SKIP = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
         "detach", "alias", "split", "split_with_sizes", "unsqueeze", "squeeze", "as_strided",
         "unbind", "chunk", "clone", "_to_copy", "empty_like", "zeros_like", "ones_like",
         "empty", "zeros", "ones", "full", "fill_", "lift_fresh", "arange", "new_empty",
         "new_zeros", "copy_", "is_same_size", "_has_compatible_shallow_copy_type", "view_as",
         "contiguous", "zero_", "resize_", "set_", "_local_scalar_dense"}


class OpProbe(TorchDispatchMode):
    def __init__(self, rec: Recorder, include: set[str] | None = None, oracle: bool = False):
        super().__init__()
        self.rec = rec
        self.occ: dict = {}
        # `--granularity auto`: ops only inside the first divergent module (or phase)
        self.include = include
        # the reference world of a second pass: every recorded op also re-executed in float64
        # (probes/float64.py) and recorded as kind "oracle" under the op's record name
        self.oracle = oracle

    def _wanted(self, module: str) -> bool:
        if self.include is None:
            return True
        return any(module == m or module.startswith(m + ".") for m in self.include)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _SKIP or not self.rec.enabled:
            return out
        rec = self.rec
        module = rec.stack[-1] if (rec.phase == "forward" and rec.stack) else rec.phase
        if not self._wanted(module):
            return out
        ns = getattr(func, "namespace", "aten")
        op = f"{ns}::{name}"
        key = (rec.step, rec.phase, module, op)
        k = self.occ.get(key, 0)
        self.occ[key] = k + 1
        flat, _ = tree_flatten(out)
        if ns == "_c10d_functional" and name != "wait_tensor":
            # An asynchronous collective's output holds its numbers only after wait_tensor (on
            # gloo it changed from run to run when recorded here), and its user may wait inside
            # a tensor subclass's dispatch, out of this mode's sight. Waiting now changes no
            # number (a later wait finds nothing pending); on CUDA it only orders the streams.
            for t in flat:
                if isinstance(t, torch.Tensor):
                    torch.ops._c10d_functional.wait_tensor(t)
        # An in-place or out= op's result is a tensor seen before whose version counter is bumped
        # only after this mode returns (ADInplaceOrView runs above it): recorded as is it would
        # pass for the earlier, unchanged record (and a queued hash would find it changed). A copy
        # of its new value is its record.
        mutable = func._schema.is_mutable
        for i, t in enumerate(x for x in flat if isinstance(x, torch.Tensor)):
            if t.is_floating_point():
                rec.add("op", module, f"{op}#{k}.{i}", t.detach().clone() if mutable else t)
        if self.oracle and rec.phase == "forward" and any(
                isinstance(x, torch.Tensor) and x.is_floating_point() for x in flat):
            self._oracle(func, args, kwargs, module, f"{op}#{k}")
        return out

    def _oracle(self, func, args, kwargs, module: str, name: str) -> None:
        from tpdiag.probes.float64 import op_oracle

        rec = self.rec
        rec.enabled = False
        try:
            out64, why = op_oracle(func, args, kwargs)
        finally:
            rec.enabled = True
        if why is not None:
            rec.oracle_notes[f"s{rec.step}/{rec.phase}/{module}/oracle#0/{name}"] = {"why": why}
            return
        flat, _ = tree_flatten(out64)
        for i, t in enumerate(x for x in flat if isinstance(x, torch.Tensor)):
            if t.is_floating_point():
                rec.add("oracle", module, f"{name}.{i}", t)
