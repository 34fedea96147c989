"""Install TP-invariant linear layers by wrapping the forward of modules found by their layout.

No model code is edited: the plan says which Linear is row- or column-parallel (at TP=1 too,
so the reference follows the same canonical order), and the wrapper calls the grouped kernels
on the local shards. Both linear fixes share one wrapper; each sets its own flag, and the
wrappers are removed when the last of them exits (in `finally`).

Two kinds of plans are handled:
- torch ParallelStyles (parallelize_module): their hooks stay; the wrapper takes the DTensor
  input the style prepared and returns a DTensor (Replicate / Shard(-1)) the output hook accepts.
- transformers' styles (`hf:` models): they replace `module.forward` with a function that
  redistributes around the Linear; the wrapper replaces that function, takes the plain local
  input, and reproduces its output layout itself (a replicated row-parallel result, a local
  column shard, or the gathered columns of `colwise_rep`), with the reductions done in tree order.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from tpdiag.base.dtensors import local_of as _local
from tpdiag.errors import BadInput
from tpdiag.fixes import linear_dtensor, state
from tpdiag.fixes.layouts import style_obj as _style_obj
from tpdiag.kernels import grad_carry, tree
from tpdiag.kernels.grouped_linear import ColBias, col_parallel_linear, row_parallel_linear

TREE = "tp-invariant-linear"
BLOCKED = "invariant-gemm"


def _targets(model: nn.Module, plan: dict):
    from tpdiag.records.styles import style_label

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            obj = _style_obj(name, plan)
            style = style_label(obj) if obj is not None else None
            if style in ("rowwise", "colwise", "colwise-gathered"):
                if getattr(obj, "hf_name", None) in ("packed_colwise", "packed_rowwise"):
                    # a _StridedShard(0, sf=2) weight: the rank's rows are its chunk of gate AND of
                    # up, so its contiguous N groups are not the global groups of TP=1
                    raise BadInput(f"--fix {TREE}: {name}: a {obj.hf_name} Linear (gate and up "
                                   "packed on one dim, a _StridedShard weight) is not a covered layout")
                yield name, mod, style, obj


class _GatherColumns(torch.autograd.Function):
    """All-gather column shards into the whole output (exact); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, y):
        w = tree.world_size()
        ctx.width = y.shape[-1]
        if w == 1:
            return y.clone()
        return tree.cat_stacked(tree.all_gather_stacked(y), -1)

    @staticmethod
    def backward(ctx, g):
        r = tree.rank() if tree.world_size() > 1 else 0
        return g[..., r * ctx.width:(r + 1) * ctx.width].contiguous()


class _SplitColumns(torch.autograd.Function):
    """This rank's slice of a replicated input's last dim (what a row-parallel style whose input is
    Replicate - transformers' rowwise_split_input, rowwise_rep - hands its local GEMM); backward
    all-gathers the slices' grads into the replicated input's whole grad (exact)."""

    @staticmethod
    def forward(ctx, x, width):
        r = tree.rank() if tree.world_size() > 1 else 0
        return x[..., r * width:(r + 1) * width].contiguous()

    @staticmethod
    def backward(ctx, g):
        if tree.world_size() == 1:
            return g, None
        return tree.cat_stacked(tree.all_gather_stacked(g.contiguous()), -1), None


def _hf_output(name: str, style: str, obj) -> str:
    """What the transformers style hands on: 'local' (column shard) or 'full'."""
    out = getattr(obj, "output_layouts", None)
    inp = getattr(obj, "input_layouts", None)
    kind = lambda p: type(p).__name__ if p is not None else None  # noqa: E731
    if style == "rowwise":
        if kind(out) not in (None, "Replicate"):
            raise BadInput(f"--fix {TREE}: {name}: row-parallel output layout {out} not supported")
        return "full"
    if kind(inp) not in (None, "Replicate"):
        raise BadInput(f"--fix {TREE}: {name}: column-parallel input layout {inp} not supported")
    return "full" if kind(out) == "Replicate" else "local"


def _wrap(name: str, mod: nn.Linear, style: str, obj, world: int):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    own = mod.__dict__.get("forward")  # a forward the TP style installed (transformers)
    orig = mod.forward
    hf = own is not None and type(obj).__module__.endswith("models.hf_plan")
    hf_out = _hf_output(name, style, obj) if hf else None
    dim = mod.in_features if style == "rowwise" else mod.out_features
    groups = tree.check(dim, world, f"{name} ({style}, {'in' if style == 'rowwise' else 'out'}"
                                    f"_features)")
    local_groups = groups // world

    specs = linear_dtensor.specs_of(mod)  # the DTensor fast path's specs

    def forward(x, *args, **kwargs):
        use_tree, use_blocked = state.active(TREE), state.active(BLOCKED)
        if style != "rowwise" and not (use_tree or use_blocked):
            return orig(x, *args, **kwargs)
        w, b = mod.weight, mod.bias
        # grad accumulation (kernels/grad_carry.py): inside an open window, with the batch-invariant
        # GEMM on, the weight grads go into fp32 carries instead of .grad per micro-batch
        carry = use_blocked and grad_carry.is_open()
        sw = grad_carry.site(w, f"{name}.weight") if carry else None
        sb = grad_carry.site(b, f"{name}.bias") if carry and b is not None else None
        if style == "rowwise" and not use_tree:
            return orig(x, *args, **kwargs)
        is_d = isinstance(w, DTensor) and not hf
        if is_d and b is None and linear_dtensor.usable(x):
            # a ParallelStyle's DTensors straight into one Function (linear_dtensor.py)
            if style == "rowwise":
                return linear_dtensor.RowLinearD.apply(x, w, local_groups, sw, specs)
            return linear_dtensor.ColLinearD.apply(x, w, local_groups, use_blocked, use_tree, sw, specs)
        xl, wl = _local(x), _local(w)
        bl = _local(b) if b is not None else None
        if style == "rowwise":
            if hf and xl.shape[-1] != wl.shape[-1] and xl.shape[-1] == wl.shape[-1] * world:
                # the style takes the whole input and splits it (transformers' rowwise_split_input:
                # OLMo2's o_proj after q/k/v gathered their columns)
                xl = _SplitColumns.apply(xl, wl.shape[-1])
            y = row_parallel_linear(xl, wl, None if sb is not None else bl, local_groups, sw)
            if sb is not None:  # the replicated bias: its grad, a sum over tokens, carried too
                y = ColBias.apply(y, bl, 1, sb)
            return DTensor.from_local(y, w.device_mesh, [Replicate()], run_check=False) if is_d else y
        y = col_parallel_linear(xl, wl, bl, local_groups, blocked=use_blocked, tree_dgrad=use_tree,
                                sites=(sw, sb))
        if is_d:
            return DTensor.from_local(y, w.device_mesh, [Shard(y.dim() - 1)], run_check=False)
        return _GatherColumns.apply(y) if hf_out == "full" else y

    mod.forward = forward
    return own


def _wrap_replicated(name: str, mod: nn.Linear):
    """A Linear no plan style shards (replicated: the same at every TP - a tied LM head, a
    projection the plan leaves whole): stock outside grad accumulation; inside an open window,
    with invariant-gemm on, its weight and bias grads (sums over tokens) go into the fp32
    carry (CarryLinear, ColBias), its forward and dx through the batch-invariant GEMM."""
    from torch.distributed.tensor import DTensor

    own = mod.__dict__.get("forward")
    orig = mod.forward

    def carried(x):
        w, b = mod.weight, mod.bias
        from tpdiag.kernels.carry_functions import CarryLinear

        y = CarryLinear.apply(x, w, grad_carry.site(w, f"{name}.weight"))
        if b is None:
            return y
        return ColBias.apply(y, b, 1, grad_carry.site(b, f"{name}.bias") if b.requires_grad else None)

    # a subclass with a forward of its own (PhiMoE's router: an nn.Linear returning (logits,
    # weights, experts)) keeps it: only its own F.linear on its weight goes through the carry
    subclass = own is None and type(mod).forward is not nn.Linear.forward

    def forward(x, *args, **kwargs):
        w, b = mod.weight, mod.bias
        if (not (state.active(BLOCKED) and grad_carry.is_open()) or not w.requires_grad
                or any(isinstance(t, DTensor) for t in (x, w, b))):
            return orig(x, *args, **kwargs)
        if subclass:
            with _LinearOf(w, b, carried):
                return orig(x, *args, **kwargs)
        if args or kwargs:
            return orig(x, *args, **kwargs)
        return carried(x)

    mod.forward = forward
    return own


class _LinearOf(torch.overrides.TorchFunctionMode):
    """F.linear(x, weight, bias) on one Linear's own weight and bias -> fn(x); any other call as is."""

    def __init__(self, weight, bias, fn):
        super().__init__()
        self.weight, self.bias, self.fn = weight, bias, fn

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2 and args[1] is self.weight \
                and (args[2] if len(args) > 2 else kwargs.get("bias")) is self.bias:
            return self.fn(args[0])
        return func(*args, **kwargs)


@contextmanager
def linear_fix(flag_name: str, model: nn.Module, plan: dict, world: int):
    from tpdiag.fixes import moe

    owner = not getattr(model, "_tpdiag_linear_wrapped", False)
    saved, experts = [], []
    try:
        if owner:
            planned = set()
            for name, mod, style, obj in _targets(model, plan):
                saved.append((mod, _wrap(name, mod, style, obj, world)))
                planned.add(id(mod))
            for name, mod in model.named_modules():
                if isinstance(mod, nn.Linear) and id(mod) not in planned and _style_obj(name, plan) is None:
                    saved.append((mod, _wrap_replicated(name, mod)))
            # MoE experts (3-D weights, no nn.Linear): the same tree over I (fixes/moe.py)
            experts = moe.wrap_experts(model, plan, world)
            model._tpdiag_linear_wrapped = True
        from contextlib import nullcontext

        from tpdiag.fixes.embedding import embedding_carry

        # grad accumulation's carry for the embeddings too (stock outside an open window)
        # (apply_fixes marks flag_name active: the wrapped forwards read it at call time)
        with embedding_carry(model) if owner else nullcontext():
            yield
    finally:
        if owner:
            for mod, own in saved:
                if own is not None:
                    mod.forward = own  # the TP style's own forward comes back
                else:
                    mod.__dict__.pop("forward", None)  # the class forward shows through again
            moe.restore(experts)
            model.__dict__.pop("_tpdiag_linear_wrapped", None)
