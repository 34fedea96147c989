"""What a capture's own optimizer step consumed: each `torch.optim.Optimizer.step` run inside the
`with` block, seen through torch's global step pre-hook.

A capture compares the parameters after the user's step (`cap.params()`), but their update is the
user's optimizer applied to the grads as the user's loop left them (after its clip, its own
all-reduces): code tpdiag never ran. Recorded here, per parameter of the captured model the step
updates: the grad the optimizer read (`opt_grad`), its state tensors before the step (`opt_state`,
`NAME.KEY`: Adam's moments), and in world.json the optimizer's class, hyper-parameters and each
parameter's step count. diff/optim_step.py re-runs that step in float64 from each side's own inputs
and judges the grads it consumed against the recorded ones; without these records a moved parameter
after the step has no bound and is `not judged`. A user's own Optimizer subclass, and torch's own
without an update rule in diff/optim_rerun.py (RMSprop, Muon...), is re-executed here, in float64 on
the whole tensors (probes/optim_shadow.py: `opt_f64` records, the entry's `f64`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from tpdiag.probes import optim_shadow
from tpdiag.records.keys import OPT_F64

# the hyper-parameters kept: JSON numbers, bools, strings and tuples of numbers (betas)
_PLAIN = (bool, int, float, str, type(None))


def _plain(v):
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
        return list(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.detach().reshape(-1)[0])  # a tensor lr
    return repr(type(v).__name__)  # kept as a word: two sides differing in it differ


def _step_count(state: dict):
    s = state.get("step")
    if isinstance(s, torch.Tensor):
        s = getattr(s, "_local_tensor", s)
        return float(s.detach().reshape(-1)[0]) if s.numel() == 1 else None
    return float(s) if isinstance(s, (int, float)) else (0.0 if not state else None)


@contextmanager
def watch_optimizers(model: torch.nn.Module, rec, style, steps: list, tp_group=None):
    """Record, at each optimizer step inside the block, the grads and state it reads for the
    parameters of `model`; `steps` gets one entry per step call (world.json `optimizer_steps`).
    style(module name) -> the plan's style label (record_params' own memo). A user's own optimizer
    class is also re-executed in float64 on the whole tensors (probes/optim_shadow.py; tp_group: the
    TP group, which agrees on whether it could be)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from tpdiag.probes.model_walk import Walk

    walk = Walk(model)
    names = {}
    for mname, short, p, cls in walk.params:
        names.setdefault(id(p), (mname or walk.root, short, mname, cls))

    calls: dict = {}

    def pre(opt, args, kwargs):
        if not rec.enabled:
            return
        entry = {"class": optim_shadow.class_name(opt), "record_step": rec.step, "groups": []}
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for group in opt.param_groups:
                hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
                owned = []
                for p in group["params"]:
                    n = names.get(id(p))
                    if n is None:
                        continue  # not a parameter of the captured model
                    owner, short, mname, cls = n
                    state = opt.state.get(p) or {}
                    owned.append({"module": owner, "name": short, "step": _step_count(state),
                                  "grad": p.grad is not None})
                    if p.grad is None:
                        continue
                    # a parameter stepped twice in one step (two optimizers over it): a call each
                    call = calls[(rec.step, owner, short)] = calls.get((rec.step, owner, short), -1) + 1
                    owned[-1]["call"] = call
                    rec.add("opt_grad", owner, short, p.grad.detach(), call=call, phase="optimizer",
                            style=style(mname), cls=cls)
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.shape == p.shape and v.is_floating_point():
                            rec.add("opt_state", owner, f"{short}.{k}", v.detach(), call=call,
                                    phase="optimizer", style=style(mname), cls=cls)
                if owned:
                    entry["groups"].append({"hyper": hyper, "params": owned})
        if entry["groups"]:
            if optim_shadow.applies(opt):
                _shadow(opt, args, kwargs, names, entry, rec, style, tp_group)
            steps.append(entry)

    handle = register_optimizer_step_pre_hook(pre)
    try:
        yield steps
    finally:
        handle.remove()


def _shadow(opt, args, kwargs, names, entry, rec, style, group) -> None:
    """The user's own step re-executed in float64 (probes/optim_shadow.py): an `opt_f64` record per
    stepped parameter (its value after the shadow step, whole), `entry["f64"]` what refused or the
    jumps the step made. Every rank of the TP group runs it (the gathers are collectives)."""
    from tpdiag.probes.optim_shadow import Refused, agree, shadow_step

    import torch.distributed as dist

    got, jumps, refused = {}, [], None
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() else None
    was, rec.enabled = rec.enabled, False  # the shadow's own ops are no records
    try:
        got, jumps = shadow_step(opt, args, kwargs, names, ranks)
    except Refused as e:
        refused = str(e)
    finally:
        rec.enabled = was
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    device = getattr(first, "_local_tensor", first).device if first is not None else torch.device("cpu")
    refused = agree(refused, group, device)
    if refused:
        entry["f64"] = {"refused": refused}
        return
    entry["f64"] = {"jumps": jumps}
    by_name = {(v[0], v[1]): k for k, v in names.items()}
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for g in entry["groups"]:
            for pe in g["params"]:
                if "call" not in pe:
                    continue
                pid = by_name.get((pe["module"], pe["name"]))
                w = got.get(pid)
                if w is None:
                    continue
                owner, short, mname, cls = names[pid]
                pe["f64"] = list(w.shape)
                # "replicate": one whole tensor on every rank (not a shard the diff would concatenate)
                rec.add(OPT_F64, owner, short, w, call=pe["call"], phase="optimizer", layout="replicate",
                        style=style(mname), cls=cls)
