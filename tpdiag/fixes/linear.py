"""Install TP-invariant linear layers by wrapping the forward of modules found by their layout.

No model code is edited: the plan says which Linear is row- or column-parallel (at TP=1 too,
so the reference follows the same canonical order), and the wrapper calls the grouped kernels
on the local shards. Both linear fixes share one wrapper; each sets its own flag, and the
wrappers are removed when the last of them exits (in `finally`).
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from tpdiag.fixes import state
from tpdiag.kernels import tree
from tpdiag.kernels.grouped_linear import col_parallel_linear, row_parallel_linear

TREE = "tp-invariant-linear"
BLOCKED = "invariant-gemm"


def _targets(model: nn.Module, plan: dict):
    from tpdiag.models.plans import style_of

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            style = style_of(name, plan or {})
            if style in ("rowwise", "colwise", "colwise-gathered"):
                yield name, mod, style


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _wrap(name: str, mod: nn.Linear, style: str, world: int):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    orig = mod.forward
    dim = mod.in_features if style == "rowwise" else mod.out_features
    groups = tree.check(dim, world, f"{name} ({style}, {'in' if style == 'rowwise' else 'out'}"
                                    f"_features)")
    local_groups = groups // world

    def forward(x):
        use_tree, use_blocked = state.active(TREE), state.active(BLOCKED)
        w = mod.weight
        is_d = isinstance(w, DTensor)
        xl, wl = _local(x), _local(w)
        bl = _local(mod.bias) if mod.bias is not None else None
        if style == "rowwise":
            if not use_tree:
                return orig(x)
            y = row_parallel_linear(xl, wl, bl, local_groups)
            return DTensor.from_local(y, w.device_mesh, [Replicate()], run_check=False) if is_d else y
        if not (use_tree or use_blocked):
            return orig(x)
        y = col_parallel_linear(xl, wl, bl, local_groups, blocked=use_blocked, tree_dgrad=use_tree)
        return DTensor.from_local(y, w.device_mesh, [Shard(y.dim() - 1)], run_check=False) if is_d else y

    mod.forward = forward
    return orig


@contextmanager
def linear_fix(flag_name: str, model: nn.Module, plan: dict, world: int):
    owner = not getattr(model, "_tpdiag_linear_wrapped", False)
    saved = []
    try:
        if owner:
            for name, mod, style in _targets(model, plan):
                saved.append((mod, _wrap(name, mod, style, world)))
            model._tpdiag_linear_wrapped = True
        with state.flag(flag_name):
            yield
    finally:
        if owner:
            for mod, orig in saved:
                # the instance attribute shadowed the class method; removing it restores it
                if "forward" in mod.__dict__:
                    del mod.forward
            model.__dict__.pop("_tpdiag_linear_wrapped", None)
