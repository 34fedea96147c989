"""The per-tensor hooks module_probes puts in: a module output's grad hook (and the tap that puts it
in without a handle), a parameter's post-accumulate grad hook, and the tensors among a hook's
arguments."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils._pytree import tree_flatten

from tpdiag.base.sparse import strided
from tpdiag.probes.oracle_hooks import param_grad_norms
from tpdiag.probes.recorder import Recorder
from tpdiag.probes.rows import consumers_of, extras

# The records' own tensor calls (detach, data_ptr, the hash queue's views) skip torch-function
# modes: a fix that is one (invariant-attention's) would see each of them (~3,400 Python calls
# per decode call of a 16-layer model on the CPU), and none of them is its to change.
no_modes = torch._C.DisableTorchFunction


def hook_tensors(args, kwargs=None):
    """The tensors among a hook's arguments or outputs, in pytree order (flat tuples of
    tensors, the common case, without flattening: hooks run per module call)."""
    if type(args) is torch.Tensor:
        return (args,)
    if not kwargs and type(args) is tuple:
        for a in args:
            if type(a) is not torch.Tensor:
                break
        else:
            return args
    flat, _ = tree_flatten((args, kwargs) if kwargs is not None else args)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def tap(t: torch.Tensor, hook, taps: list) -> None:
    """t.register_hook(hook) for a plain tensor with a grad_fn, without the handle: the same hook
    dict, filled the way Tensor.register_hook fills it, so autograd calls the hook at the same
    point, in the same order among t's hooks. register_hook took ~9 us a call on a 2-core host
    (its RemovableHandle ~3, the function-level import and three reads of t._backward_hooks the
    rest) and a step registers one per module output: ~200 a llama-1b step, host time a
    host-bound step pays. The key is an object of ours: RemovableHandle ids count from a global
    counter, and a user's hook on t must not be overwritten."""
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        t.grad_fn._register_hook_dict(t)
    key = object()
    hooks[key] = hook
    taps.append((hooks, key))


def grad_hook(rec: Recorder, name: str, idx: str, call: int, style, cls, fwd_meta,
               partial: bool = False):
    def hook(g):
        with no_modes():
            m = rec.add("grad_out", name, idx, g, call=call, phase="backward", style=style, cls=cls,
                        layout="partial" if partial else None)
        if m is not None and fwd_meta is not None:
            extras(m)["consumers"] = sorted(set(consumers_of(fwd_meta)))
        return None

    return hook


def param_grad_hook(rec: Recorder, mname: str, short: str, style, cls, pend: dict | None = None,
                     side_pend: dict | None = None, hold=None):
    """hold(mname, short, p, record): True where the grad is held to be recorded once, later (a
    module called in two reentrant checkpoints: module_probes)."""
    from tpdiag.kernels.grad_carry import carried

    def hook(p):
        if carried(p):
            # grad accumulation's window holds this grad in its fp32 carry: autograd's own
            # accumulation inside the window is not the grad (on an H100 with torch 2.11 a TP=2
            # vocab-parallel embedding's was recorded here and again at the close); the close
            # runs this hook once with the real grad
            return
        if hold is not None and hold(mname, short, p, record):
            return
        record(p)

    def record(p):
        g = p.grad
        if type(g) is not torch.Tensor and getattr(g, "placements", None) \
                and any(pl.is_partial() for pl in g.placements):
            # A replicated weight under sequence parallelism accumulates an unreduced (Partial)
            # grad; DTensor reduces it later, in the optimizer. Record the reduced value: the
            # same all-reduce, on a copy, in the same order on every rank.
            g = g.full_tensor()
        with no_modes():
            rec.add("param_grad", mname, short, g, phase="backward", style=style, cls=cls)
            if pend:
                with rec._paused():
                    g = strided(g)  # a sparse grad's norms against its float64 value: its dense value's, as recorded
                param_grad_norms(rec, pend, mname, short, g, cls)
            if side_pend:
                from tpdiag.probes.own_side_norms import flush

                flush(rec, side_pend, mname, short, cls)

    return hook
