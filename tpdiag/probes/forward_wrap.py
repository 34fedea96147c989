"""A module probed through its `forward` instead of forward hooks (probes/module_probe.py): without
hooks nn.Module's call goes straight to forward, ~10 us a call less on a 2-core host."""
from __future__ import annotations

import functools

from torch import nn

_NONE = object()


def global_module_hooks() -> bool:
    from torch.nn.modules import module as m

    return bool(m._global_forward_pre_hooks or m._global_forward_hooks)


def wrap_forward(mod: nn.Module, pre_hook, fwd_hook, wrapped: list) -> bool:
    """Probe a module that has no forward hooks through its `forward` instead of hooks: a module
    with any hook takes nn.Module's slow call path (a closure, the hook loops, the backward-hook
    checks), ~10 us per call on a 2-core host and most of what the hooks alone cost a step
    (`python -m benchmarks probes host`); without hooks the call goes straight to forward. The
    same calls, arguments and outputs reach pre_hook and fwd_hook as hooks would pass them: no
    other hook runs around this module's forward (none is registered, nor a global one)."""
    own = mod.__dict__.get("forward", _NONE)
    inner = mod.forward

    def forward(*args, **kwargs):
        pre_hook(mod, args, kwargs)
        out = inner(*args, **kwargs)
        res = fwd_hook(mod, args, kwargs, out)
        return out if res is None else res

    try:
        functools.update_wrapper(forward, inner)  # the signature, for code that inspects it
        mod.__dict__["forward"] = forward
    except (AttributeError, TypeError):  # a module that will not take one (TorchScript)
        return False
    wrapped.append((mod, own, forward))
    return True


def unwrap(wrapped: list) -> None:
    for mod, own, ours in wrapped:
        if mod.__dict__.get("forward") is not ours:
            continue  # replaced inside the block by someone else: theirs stays
        if own is _NONE:
            del mod.__dict__["forward"]
        else:
            mod.__dict__["forward"] = own
