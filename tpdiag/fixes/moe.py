"""tp-invariant-linear for MoE experts: transformers' `moe_tp_experts` layout, found by the plan.

Each rank of a `moe_tp_experts` module holds a slice of every expert's intermediate dimension I
and its partial output is all-reduced (the experts' down projection is a row-parallel reduction
the Linear wrapper never sees: the experts are 3-D parameters, not nn.Linear). The wrapper here
replaces the module's forward (the TP style's, or the class's at TP=1, so the reference takes
the same order): I is cut into the run's G groups (kernels/grouped_experts.py), each group runs
the experts' own class forward on its weight slices, and the groups are summed by the fixed tree
across ranks. No model code is edited; the forward is restored in `finally`.

Which layouts are covered is read from the plan's per-parameter styles (COVERED below); anything
else is refused in one line naming the layout, before any world starts where the plan is known
(check_plan) and in the world otherwise.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn

from tpdiag.base.dtensors import local_of as _local
from tpdiag.errors import BadInput
from tpdiag.fixes import state
from tpdiag.fixes.layouts import MOE_LAYOUTS, style_obj

TREE = "tp-invariant-linear"
EXPERTS_STYLE = "moe_tp_experts"
# the per-parameter styles whose cut of an expert weight is along I (kernels/grouped_experts.py)
SHARDED = ("packed_colwise", "rowwise", "colwise")
# a replicated expert parameter the fix can add once: the down projection's bias (gpt_oss)
REPLICATED_OK = ("down_proj_bias",)
# the style that adds such a bias on one rank only (models/hf_plan.py): the fix adds it itself
ONCE = "replicated_once"
COVERED = MOE_LAYOUTS


def param_layout(style: str | None, pname: str, ndim: int) -> tuple[int, int] | None:
    """(dim, split factor) along which transformers' `style` cuts parameter `pname` of `ndim`
    dims (what its shard_param does), or None for a replicated one."""
    if style in (None, EXPERTS_STYLE, "replicate", ONCE):
        return None
    if style == "packed_colwise":
        return (ndim - 2, 2) if ndim >= 2 else (ndim - 1, 1)
    if style == "rowwise":
        return None if pname == "bias" else (ndim - 1, 1)
    if style == "colwise":
        return (max(ndim - 2, 0), 1)
    raise BadInput(f"--fix {TREE}: MoE experts parameter {pname} with style {style!r} is not a "
                   f"covered layout (covered: {'; '.join(COVERED)})")


def _uncovered(name: str, what: str) -> BadInput:
    return BadInput(f"--fix {TREE}: {name}: MoE experts layout not covered ({what}); covered: "
                    f"{'; '.join(COVERED)}")


def check_plan(plan: dict | None) -> None:
    """A transformers base_model_tp_plan ({pattern: style name}) whose MoE experts the fix cannot
    cover is refused in one line, before any world starts."""
    for key, style in (plan or {}).items():
        if style == "moe_identity_expert":
            raise _uncovered(key, "moe_identity_expert: zero experts whose input is divided by TP "
                                  "and summed with the routed experts")
        if style in ("packed_colwise", "packed_rowwise") and not _under_experts(key, plan):
            raise BadInput(f"--fix {TREE}: {key}: a {style} Linear (a _StridedShard(dim, sf=2) "
                           "weight: gate and up packed on one dim) is not a covered layout; "
                           "covered: unpacked colwise / rowwise Linear and MoE experts")
        if style != EXPERTS_STYLE:
            continue
        for k, s in plan.items():
            if k.startswith(key + ".") and s not in SHARDED and s != ONCE:
                raise _uncovered(key, f"{k.rpartition('.')[2]} is {s}")


def _under_experts(key: str, plan: dict) -> bool:
    owner = key.rpartition(".")[0]
    return plan.get(owner) == EXPERTS_STYLE


def _layouts(name: str, mod: nn.Module, obj, world: int, groups: int):
    """{param: (dim, sf)} of the sharded expert parameters and the replicated ones, checked."""
    from tpdiag.kernels import tree

    styles = getattr(obj, "param_styles", {}) or {}
    sharded, replicated = {}, []
    for pname, p in mod.named_parameters(recurse=False):
        lay = param_layout(styles.get(pname), pname, p.dim())
        placements = getattr(p, "placements", None)
        if lay is None:
            if placements and not all(pl.is_replicate() for pl in placements):
                raise _uncovered(name, f"{pname} is {placements} where the plan replicates it")
            if pname not in REPLICATED_OK:
                raise _uncovered(name, f"replicated parameter {pname}")
            replicated.append(pname)
            continue
        dim, sf = lay
        if dim == 0:
            raise _uncovered(name, f"{pname} cut along dim 0 (the experts, not I)")
        if placements is not None:
            got = _placement_layout(placements, p.dim())
            if got != (dim, sf):
                raise _uncovered(name, f"{pname} is {placements}, expected cut (dim={dim}, sf={sf})")
        whole = p.shape[dim]  # a DTensor's shape is the global one; at TP=1 the param is whole
        if whole % (groups * sf):
            raise BadInput(f"--fix {TREE}: {name}.{pname}: dim {dim} of size {whole} is not "
                           f"divisible by {groups} groups x {sf} blocks")
        sharded[pname] = (dim, sf)
    if not sharded:
        raise _uncovered(name, "no expert parameter is cut across ranks")
    if replicated and not getattr(mod, "has_bias", False):
        raise _uncovered(name, f"replicated {', '.join(replicated)} without has_bias")
    tree.check(groups, world, f"{name} (MoE experts)")
    return sharded, replicated


def _placement_layout(placements, ndim: int) -> tuple[int, int] | None:
    if len(placements) != 1:
        return None
    p = placements[0]
    if type(p).__name__ == "_StridedShard":
        return int(p.dim) % ndim, int(p.split_factor)
    if p.is_shard():
        return int(p.dim) % ndim, 1
    return None


@contextmanager
def _swapped(mod: nn.Module, tensors: dict):
    """The group's weight slices in place of the parameters, and the children (act_fn) called
    through their plain forward: a group's activation is a slice no other degree records as one
    tensor (its layout cannot be told from its shape), so it is not recorded, like the inside of
    a wrapped Linear; the experts' output is."""
    saved = {k: mod._parameters[k] for k in tensors}
    kids = dict(mod._modules)
    mod._parameters.update(tensors)
    # the class forward: an instance `forward` may be a probe's recording wrapper
    mod._modules.update({k: type(m).forward.__get__(m) for k, m in kids.items() if m is not None})
    try:
        yield
    finally:
        mod._parameters.update(saved)
        mod._modules.update(kids)


def _bias_term(bias, top_k_index, top_k_weights):
    """sum over a token's experts of weight * bias (what adding the replicated bias inside each
    expert contributes), computed once on every rank after the tree."""
    return (top_k_weights.unsqueeze(-1) * bias[top_k_index]).sum(-2)


def _wrap(name: str, mod: nn.Module, obj, world: int):
    from tpdiag.kernels import tree
    from tpdiag.kernels.grouped_experts import fan_out, group_slices

    groups = tree.n_groups()
    sharded, replicated = _layouts(name, mod, obj, world, groups)
    local_groups = groups // world
    own = mod.__dict__.get("forward")  # the TP style's forward (TP > 1)
    orig = mod.forward
    cls_forward = type(mod).forward

    sig = inspect.signature(cls_forward)  # (self, hidden_states, top_k_index, top_k_weights, ...)
    names = list(sig.parameters)[1:4]
    if len(names) < 3:
        raise _uncovered(name, f"forward{sig} does not take (hidden_states, top-k index, top-k weights)")

    def forward(*args, **kwargs):
        if not state.active(TREE):
            return orig(*args, **kwargs)
        bound = sig.bind(mod, *args, **kwargs)
        hidden_states, top_k_index, top_k_weights = (bound.arguments[n] for n in names)
        x, w = _local(hidden_states), _local(top_k_weights)
        xs = fan_out(x, local_groups)
        ws = fan_out(w, local_groups) if w.is_floating_point() else (w,) * local_groups
        pieces = {p: group_slices(_local(mod._parameters[p]), d, sf, local_groups)
                  for p, (d, sf) in sharded.items()}
        zeros = {p: torch.zeros_like(_local(mod._parameters[p])) for p in replicated}
        outs = []
        for j in range(local_groups):
            with _swapped(mod, {**{p: v[j] for p, v in pieces.items()}, **zeros}):
                bound.arguments.update({names[0]: xs[j], names[2]: ws[j]})
                outs.append(cls_forward(*bound.args, **bound.kwargs).float())
        y = tree.tree_all_reduce(tree.tree_sum(outs), x.dtype)
        for p in replicated:
            y = y + _bias_term(_local(mod._parameters[p]), top_k_index, w).to(y.dtype)
        return y

    mod.forward = forward
    return own


def experts_targets(model: nn.Module, plan: dict):
    for name, mod in model.named_modules():
        obj = style_obj(name, plan)
        if obj is not None and getattr(obj, "hf_name", None) == EXPERTS_STYLE:
            yield name, mod, obj


def wrap_experts(model: nn.Module, plan: dict, world: int) -> list:
    """[(module, its own forward or None)] for restore_experts."""
    saved = []
    try:
        for name, mod, obj in experts_targets(model, plan):
            saved.append((mod, _wrap(name, mod, obj, world)))
    except BaseException:
        restore(saved)
        raise
    return saved


def restore(saved: list) -> None:
    for mod, own in saved:
        if own is not None:
            mod.forward = own
        else:
            mod.__dict__.pop("forward", None)
