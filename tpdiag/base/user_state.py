"""Python state of the user's code that no tensor holds: the module-level globals of the files that
define the model's classes (a call counter `global CALLS; CALLS += 1`, a cache dict at module
level) and the plain containers a module keeps as attributes (`self.seen["calls"] += 1`).

tpdiag runs the user's code more often than the user does: the float64 re-execution runs a module's
forward again (probes/float64.py), and a world's self-check runs the whole step twice (unprobed,
then probed: runner/worker.py). A counter or cache written by those extra runs changed what the
real run computed next - a second pass that "computed another step than the first pass", a
self-check that failed, both inconclusive though the model is correct. `take` keeps that state
before the extra run and `put_back` restores it after, by identity, containers in place.

What is not covered: globals of a file that defines none of the model's classes (a helper module
the forward calls into), containers nested deeper than one level, state in C extensions or files.
"""
from __future__ import annotations

import types

# torch's own per-module bookkeeping (restored by its own rules, or left to those who change it:
# hook containers that probes and fixes register into and remove from)
TORCH_KEYS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
})
_CONTAINERS = (dict, list, set)
# what a file's globals hold that no run changes in place (its imports, functions, classes)
_FIXED = (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType)
_BY_CLASS: dict = {}


def _globals_of(cls) -> list[dict]:
    """The globals dicts of the user's files among cls's classes (its MRO), by their functions."""
    hit = _BY_CLASS.get(cls)
    if hit is None:
        from tpdiag.base.user_code import _internal

        seen, hit = set(), []
        for c in cls.__mro__:
            for fn in vars(c).values():
                fn = getattr(fn, "__func__", fn)
                code = getattr(fn, "__code__", None)
                g = getattr(fn, "__globals__", None)
                if code is None or g is None or id(g) in seen or _internal(code.co_filename):
                    continue
                seen.add(id(g))
                hit.append(g)
        _BY_CLASS[cls] = hit
    return hit


def _contents(v):
    return dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else set(v)


def _keep(d: dict, skip=frozenset()) -> tuple:
    """(d, its items by identity, the contents of each plain container among them)."""
    items = {k: v for k, v in d.items() if k not in skip}
    inner = {k: _contents(v) for k, v in items.items() if type(v) in _CONTAINERS}
    return d, items, inner


def take(modules, attrs: bool = True) -> list:
    """The user's Python state around the given nn.Modules: their files' globals and (attrs) their
    attributes, plain containers by their contents, as they are now."""
    out, seen = [], set()
    for m in modules:
        if attrs:
            out.append(_keep(vars(m), TORCH_KEYS))
        for g in _globals_of(type(m)):
            if id(g) not in seen:
                seen.add(id(g))
                out.append(_keep(g, frozenset(k for k, v in g.items() if isinstance(v, _FIXED))))
    return out


def put_back(kept: list) -> None:
    """Every name kept bound to what it was, containers holding what they held, names added since
    removed (a global or attribute a run created). Attributes of torch's own are not touched."""
    for d, items, inner in kept:
        for k in [k for k in d if k not in items and k not in TORCH_KEYS and not isinstance(d[k], _FIXED)]:
            del d[k]
        for k, v in items.items():
            if d.get(k, d) is not v:
                d[k] = v
        for k, was in inner.items():
            v = items[k]
            if _contents(v) != was if isinstance(v, set) else not _same(v, was):
                if isinstance(v, dict):
                    v.clear()
                    v.update(was)
                elif isinstance(v, list):
                    v[:] = was
                else:
                    v.clear()
                    v |= was


def _same(v, was) -> bool:
    """Contents equal by identity (a tensor's == is no answer)."""
    if isinstance(v, dict):
        return v.keys() == was.keys() and all(v[k] is was[k] for k in was)
    return len(v) == len(was) and all(a is b for a, b in zip(v, was))
