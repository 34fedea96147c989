"""The float64 re-execution's dtypes and the state a forward writes (probes/float64.py): each
floating dtype's float64 (complex128) counterpart, and a module's buffers as they were before its real
forward - a forward that writes its own state (a load-balancing bias, an amax history, a running
statistic) leaves the module holding the new values by the time it is re-executed, and the
re-execution must start from the ones the real forward read."""
from __future__ import annotations

import torch

F64 = torch.float64
_UP = {torch.float32: F64, torch.float16: F64, torch.bfloat16: F64, torch.complex64: torch.complex128,
       torch.complex32: torch.complex128}
# a float8 dtype reads as floating too; no float64 value rounds back to it faithfully, but as an
# oracle input it is exact


def _up_dtype(d):
    if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex):
        return _UP.get(d, F64 if d.is_floating_point else d)
    return d


class Before(list):
    """buffers_before's list, with `py`: the user's Python state the forward may change (a call
    counter in a global of the model's file or in a dict the module holds: base/user_state.py),
    as it was before the real forward - the re-execution runs from it, as from the buffers."""
    py: list | None = None


def buffers_before(mod: torch.nn.Module, shared: dict | None = None) -> list:
    """The module's buffers as they are now, before its real forward: each (owner, name, the tensor,
    its version counter, a private copy). A forward that writes its own state (a load-balancing
    bias, an amax history, a running statistic) leaves the module holding the new values by the
    time it is re-executed; the re-execution must start from the ones the real forward read.
    shared: one dict for every call of a forward (probes/module_probe.py): a buffer unchanged since
    an enclosing module's call copied it (the same tensor, the same version counter) takes that
    copy - copied afresh at each level, a buffer of a layer whose model, block and attention are
    all re-executed was held depth times over, to the step's backward (a KV cache at real size)."""
    import weakref

    from tpdiag.base.user_state import take

    seen: dict = {} if shared is None else shared
    out = Before()
    out.py = take(list(mod.modules()))
    for m in mod.modules():
        for k, b in m._buffers.items():
            if b is None:
                continue
            got = seen.get(id(b))
            # the copies are never written (_as_before writes a float64 copy of one), so one serves
            # every call that read the same bits; weak: it lives as long as a snapshot holds it. The
            # bits are compared too: a write through `.data` moves no version counter
            copy = got[2]() if got is not None and got[0]() is b and got[1] == b._version else None
            if copy is not None and not _same_bits(copy, b):
                copy = None
            if copy is None:
                copy = b.detach().clone()
                seen[id(b)] = (weakref.ref(b), b._version, weakref.ref(copy))
            out.append((m, k, b, b._version, copy))
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same values (a DTensor's local shards: comparing two DTensors would be a
    collective); False where they cannot be compared (a meta tensor), or hold a NaN."""
    try:
        return torch.equal(getattr(a, "_local_tensor", a).detach(), getattr(b, "_local_tensor", b).detach())
    except Exception:  # noqa: BLE001 - not comparable: a fresh copy, as before any was shared
        return False


def _as_before(buffers) -> None:
    """Inside float64_isolated.isolated: each buffer the real forward wrote (its version moved, or
    another tensor put in its place) replaced, for the re-execution only, by a float64 copy of the value it had
    before that forward - the oracle's own tensor, which it may write as the real forward wrote the
    real one. A buffer the real forward left alone stays (a write to it is still refused)."""
    made: dict = {}
    swapped = []
    for m, k, was, version, copy in buffers or ():
        # its bytes too: a write through `.data` moves no version counter (model_walk.written_since)
        if m._buffers.get(k) is was and was._version == version and _same_bits(copy, was):
            continue
        mine = made.get(id(copy))
        if mine is None:
            mine = made[id(copy)] = copy.to(_up_dtype(copy.dtype), copy=True)
        m._buffers[k] = mine
        swapped.append((m, k))
    return swapped


def _written_values(mod: torch.nn.Module, swapped) -> dict:
    """{path of the buffer under mod ('amax', 'sub.amax'): the float64 value the re-execution left
    in it} for the buffers _as_before put in - what the real forward should have written there."""
    names = {m: n for n, m in mod.named_modules()}
    out = {}
    for m, k in swapped:
        t = m._buffers.get(k)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and m in names:
            out[f"{names[m]}.{k}" if names[m] else k] = t.detach()
    return out


# the hook tables a module keeps (torch.nn.Module's own attributes): a forward that registers a
# hook on a submodule at its first call registers it again in its re-execution
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


def tensor_hooks(mods) -> list:
    """The hook tables of mods as they are now, each (owner, attribute, its keys): the grad hooks of every
    parameter and buffer (`_backward_hooks`, `_post_accumulate_grad_hooks`), each module's forward /
    backward / state-dict hooks, and torch's global module hooks. A forward that registers a hook on
    its first call (`self.w.weight.register_hook(halve)` once the plan has replaced the parameter, or
    `self.w2.register_forward_hook(damp)`) did so again in its float64 re-execution, on the REAL
    weight or module (the re-execution runs the module itself under a dispatch mode): the step's
    grad then went through the hook twice - halved twice (grad_hook_plan:hook_after: a second pass
    that "computed another step", unknown) - and the next step's output was damped twice."""
    import torch.nn.modules.module as module_mod

    # (owner, attribute, its keys now): a tensor's table is None until its first hook, so the
    # table is looked up again when the hooks are taken back
    out = []
    for m in mods:
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                out += [(t, a, set(getattr(t, a, None) or ())) for a in ("_backward_hooks", "_post_accumulate_grad_hooks")]
        out += [(m, a, set(m.__dict__.get(a) or ())) for a in _MODULE_HOOKS]
    out += [(module_mod, a, set(getattr(module_mod, a, None) or ())) for a in _GLOBAL_HOOKS]
    return out


def drop_added_hooks(kept: list) -> None:
    """Removes the hooks registered since tensor_hooks (as their handles' remove() would)."""
    for owner, attr, was in kept:
        d = getattr(owner, attr, None)
        for k in [k for k in (d or ()) if k not in was]:
            del d[k]
