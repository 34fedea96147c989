"""The grad hooks on the user's parameters, kept and put back around a float64 re-execution.

The re-execution runs a module's forward again on its real parameters (probes/float64.py: the mode
upcasts them on the fly), from the user's Python state before the real call (base/user_state.py). A
forward that registers a grad hook on a parameter the first time it runs (`if self.later:
self.w2.weight.register_hook(halve); self.later = False` - grad_hook_plan.py:hook_after, a hook on
the parameter the plan left) registered it a second time there: the real backward then halved w2's
grad twice, the second pass "computed another step than the first pass" and the correct twin read
class unknown, `gate --allow rounding` 1 (red team hred16). The hook dicts are restored in place:
autograd reads a leaf's hooks from that dict object, so emptying it removes what the re-execution
added.
"""
from __future__ import annotations

_ATTRS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def take(modules) -> list:
    """[(parameter, attribute, its hooks as a dict or None)] for every parameter the modules hold."""
    out, seen = [], set()
    for m in modules:
        for p in m._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            for a in _ATTRS:
                d = getattr(p, a, None)
                out.append((p, a, None if d is None else dict(d)))
    return out


def put_back(kept: list) -> None:
    """Each parameter's hook dicts holding what they held, by identity, in place."""
    for p, a, was in kept:
        d = getattr(p, a, None)
        if d is None:
            continue
        was = was or {}
        if d.keys() != was.keys() or any(d[k] is not v for k, v in was.items()):
            d.clear()
            d.update(was)
