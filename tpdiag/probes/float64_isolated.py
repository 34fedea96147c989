"""The float64 re-execution of a module with the step's state out of its reach (probes/float64.py):
what the dispatch mode cannot see as a write - an attribute or buffer the module assigns anew, the
user's Python state, a hook registered on a real weight, the fixes' gradient-accumulation window -
is put back as it was."""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from tpdiag.probes.float64_state import drop_added_hooks, tensor_hooks


@contextmanager
def isolated(mod: torch.nn.Module, buffers=None):
    """The re-execution of mod with the step's state out of its reach: no carry window open, and
    every submodule's attributes, parameters and buffers as they were before, by identity. The
    user's Python state (buffers.py: probes/float64_state.Before) runs as it was before the real
    forward and is put back after: a counter the real call advanced is not advanced twice."""
    from tpdiag.fixes.attention import exact_attention
    from tpdiag.kernels.grad_carry import suspended

    from tpdiag.base.user_state import put_back, take

    mods = list(mod.modules())
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in mods]
    # the user's Python state beside them: a call counter in a global or in a dict the module
    # holds, which a second run of the forward would advance for the real run's next call
    kept = take(mods)
    hooks = tensor_hooks(mods)  # a hook the forward registers on a real weight: not left behind
    try:
        if getattr(buffers, "py", None) is not None:
            put_back(buffers.py)
        with suspended(), exact_attention(), warnings.catch_warnings():
            # a composite op (rms_norm, layer_norm) sees the float64 input beside the float32
            # weight before the mode upcasts it and warns it cannot use its fused kernel; the
            # decomposed ops it falls back to run in float64, so the warning is only noise in the
            # user's output
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            yield
    finally:
        for m, attrs, params, bufs in saved:
            for d, was in ((m.__dict__, attrs), (m._parameters, params), (m._buffers, bufs)):
                for k in [k for k in d if k not in was]:
                    del d[k]
                for k, v in was.items():
                    if d.get(k, d) is not v:
                        d[k] = v
        drop_added_hooks(hooks)
        put_back(kept)
