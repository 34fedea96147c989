"""The children's output grads in a module's float64 backward (probes/float64.module_oracle_grads'
taps): the exact value of an output grad that leaves a child by the module's own code
(`h * sigmoid(gate(h))`), which no module consumer's backward makes (diff/enclosing.py)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpdiag.probes.float64_state import _up_dtype


@contextmanager
def tapping(mod: torch.nn.Module, taps: dict | None, into: list):
    """Forward hooks on the submodules in taps, for the re-execution: each call's floating outputs
    appended to `into` as ("tap:NAME:J:O", tensor, its version), O the output's index among the
    call's tensors (the records' numbering: probes/module_probe.py)."""
    handles = []
    calls: dict = {}

    def hook_of(name: str):
        def hook(_m, _args, out):
            j = calls.get(name, 0)
            calls[name] = j + 1
            leaves, spec = tree_flatten(out)
            changed = False
            o = -1
            for i, t in enumerate(leaves):
                if not isinstance(t, torch.Tensor):
                    continue
                o += 1
                if not (t.is_floating_point() or t.is_complex()):
                    continue
                if not t.requires_grad and t.grad_fn is None:
                    # made from constants only (the children's weights are, and the root's inputs are
                    # token ids): a leaf of the graph in its place, so the grad reaches it. A float64
                    # copy, never the tensor itself: a child may return its own buffer (a fixed scale
                    # table), the user's real state - made to require grad it went on doing so after
                    # the re-execution (its .grad filled every later step), and as a float32 leaf in
                    # this float64 graph autograd refused the backward ("expected dtype Float but got
                    # double"): the enclosing module not judged at all (planted tap_buffer.py)
                    t = leaves[i] = t.detach().to(_up_dtype(t.dtype), copy=True).requires_grad_(True)
                    changed = True
                into.append((f"tap:{name}:{j}:{o}", t, t._version))
            return tree_unflatten(leaves, spec) if changed else None
        return hook
    try:
        for child, name in (taps or {}).items():
            handles.append(child.register_forward_hook(hook_of(name)))
        yield
    finally:
        for h in handles:
            h.remove()
