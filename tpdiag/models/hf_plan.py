"""transformers' own TP plan of an `hf:` model as torch ParallelStyles (tpdiag.models.hf builds
the model; this file shards it).

Each style name in the model's `tp_plan` is mapped to the very `TensorParallelLayer` object
transformers registers for it and wrapped as a torch `ParallelStyle`, so the numerics tpdiag
diagnoses are transformers' TP, not a re-implementation. transformers is imported lazily.
"""
from __future__ import annotations

import re

from tpdiag.errors import BadInput

# tpdiag reads a style's layout from its class name (tpdiag.records.styles.style_label), so each
# wrapper class carries the torch name of the layout the transformers style implements.
_LAYOUT_NAMES = {
    "ColwiseParallel": "ColwiseParallel",
    "ColwiseGatherInput": "ColwiseParallel",  # tpdiag's own (below): labelled 'colwise-gathered'
    "PackedColwiseParallel": "ColwiseParallel",
    "RowwiseParallel": "RowwiseParallel",
    "PackedRowwiseParallel": "RowwiseParallel",
    "SequenceParallel": "SequenceParallel",
}
_CLASSES: dict[str, type] = {}


def _layout_name(hf_style) -> str:
    cls = type(hf_style).__name__
    if cls == "EmbeddingParallel":
        # shard_dim 0 is the vocab-parallel embedding: torch calls that RowwiseParallel.
        return "RowwiseParallel" if getattr(hf_style, "shard_dim", 0) == 0 else "ColwiseParallel"
    return _LAYOUT_NAMES.get(cls, cls)


def hf_style(name: str | None, param_styles: dict[str, str] | None = None, tied: dict | None = None,
             config=None):
    """A torch ParallelStyle applying transformers' registered style `name` (None: params only).

    `config`: the model's text config, which some styles read from the module they shard.
    """
    from torch.distributed.tensor.parallel.style import ParallelStyle

    layout = _layout_name(_registered(name)) if name else "HFParamStyle"
    cls = _CLASSES.get(layout)
    if cls is None:
        cls = type(layout, (_HFStyle, ParallelStyle), {"__module__": __name__})
        _CLASSES[layout] = cls
    return cls(name, param_styles or {}, tied, config)


# Styles that read the model's text config from the module they apply to; transformers'
# apply_tensor_parallelism sets `module.config` for these before installing the forward.
_NEEDS_CONFIG = ("mla_kv_a_proj",)  # splits kv_a_proj's output at qk_rope_head_dim
# Styles that all-reduce their output's gradient (part of it) inside the module's own backward:
# the grad at the module's output is each rank's partial (mla_kv_a_proj: the rope columns, read
# by every rank's local heads), so tpdiag records it as a partial, not a replica.
_OUTPUT_GRAD_PARTIAL = ("mla_kv_a_proj",)
# Styles whose module output is each rank's share of a sum reduced later, not a replica:
# moe_identity_expert (longcat_flash's zero experts) divides its input by TP because
# moe_tp_experts all-reduces the experts' sum afterwards.
_OUTPUT_PARTIAL = ("moe_identity_expert",)


class _HFStyle:
    """Apply one transformers TP style to a module, as `apply_tensor_parallelism` does."""

    def __init__(self, name: str | None, param_styles: dict[str, str], tied: dict | None = None,
                 config=None):
        self.hf_name = name
        self.config = config
        self.output_grad_partial = name in _OUTPUT_GRAD_PARTIAL
        self.output_partial = name in _OUTPUT_PARTIAL
        self.param_styles = dict(param_styles)
        self.tied = {} if tied is None else tied  # shared by a plan's styles: {id(param): (param, shard)}
        inner = self._style(name) if name else None
        # Exposed for tpdiag's layout labels ('colwise' vs 'colwise-gathered'), and for
        # runner/logits.py, which finds the head whose plain output is a local vocab shard.
        self.input_layouts = getattr(inner, "input_layouts", None)
        self.output_layouts = getattr(inner, "output_layouts", None)
        self.use_local_output = getattr(inner, "use_local_output", None)

    @staticmethod
    def _style(name: str):
        return _registered(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(hf={self.hf_name!r})"

    def _apply(self, module, mesh):
        for pname, _ in list(module.named_parameters(recurse=False)):
            sname = self.param_styles.get(pname, self.hf_name)
            if sname is None:
                continue
            orig = module._parameters[pname]
            style = self._style(sname)
            style.validate_param(module, pname, mesh, parameter_name=pname)
            # transformers shards with src_data_rank=None: each rank keeps its slice of its own
            # full copy. Every rank built the same full weights, so that is the shard of TP=1's.
            style.shard_param(module, pname, mesh)
            self._keep_tied(module, pname, orig)
        once = [p for p, s in self.param_styles.items() if s == ONCE and p in module._parameters]
        if self.hf_name == "replicated_with_grad_allreduce":
            _grad_allreduce_now(module, mesh)
        elif self.hf_name is not None:
            if self.hf_name in _NEEDS_CONFIG:
                if self.config is None:
                    raise BadInput(f"transformers style {self.hf_name!r} on {type(module).__name__} "
                                   "needs the model's config (build the plan with tp_plan_of(model))")
                module.config = self.config
            self._style(self.hf_name).install_forward(module, mesh)
        if once:
            _add_once(module, once, mesh)
        module._is_hooked = True
        return module

    def _keep_tied(self, module, pname: str, orig) -> None:
        """A weight shared by two modules (tied embedding and LM head) stays one parameter.

        Sharding replaces a module's parameter; done twice it would silently untie the weights,
        so TP > 1 would train two tensors where TP = 1 trains one. transformers re-ties after
        sharding; here the second module gets the first module's sharded parameter, provided
        both styles shard it the same way.
        """
        new = module._parameters[pname]
        if new is orig:
            return
        seen = self.tied.get(id(orig))
        if seen is None:
            self.tied[id(orig)] = (orig, new)  # orig kept alive: its id stays unique
            return
        first = seen[1]
        if getattr(first, "placements", None) != getattr(new, "placements", None):
            raise BadInput(f"tied weight {pname!r} of {type(module).__name__} is sharded two ways "
                           f"({first.placements} and {new.placements}) by the model's TP plan")
        module._parameters[pname] = first


# tpdiag's own styles, for layouts transformers has no name for (used by models/plans_hf.py):
# - colwise_gather_input: a column-parallel Linear whose input is the rank's shard of its last
#   dim (all-gathered first): doge's dt_proj, which mixes every kv head's values into one value
#   per kv head, the rank's local heads' columns kept.
# - replicated_once: a replicated parameter added inside a module whose output is summed over
#   ranks (gpt_oss's experts' down_proj_bias under moe_tp_experts): rank 0 adds it, the other
#   ranks add zeros, so the sum counts it once (vLLM zeroes it on ranks other than 0).
ONCE = "replicated_once"
_OWN: dict = {}


def _registered(name: str):
    """The TensorParallelLayer of style `name`: tpdiag's own, else transformers' registry."""
    if name in ("colwise_gather_input", ONCE):
        if name not in _OWN:
            _OWN.update(_own_styles())
        return _OWN[name]
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return ALL_PARALLEL_STYLES[name]


def _own_styles() -> dict:
    from torch.distributed.tensor import DTensor, Shard
    from transformers.distributed.tensor_parallel import ColwiseParallel, TensorParallelLayer

    class ColwiseGatherInput(ColwiseParallel):
        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            x = args[0]
            # a plain input is this rank's shard of the last dim; as a DTensor it is all-gathered
            # by ColwiseParallel (whose no-grad fast path would otherwise take it as replicated)
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
            return super().transform_inputs_pre_forward(module, (x,) + tuple(args[1:]), kwargs, mesh)

    # a parameter style: the parameter stays a plain replicated tensor; _add_once does the rest
    return {"colwise_gather_input": ColwiseGatherInput(input_layouts=Shard(-1), output_layouts=Shard(-1)),
            ONCE: TensorParallelLayer()}


def _add_once(module, pnames: list, mesh) -> None:
    """Run `module` with its `pnames` parameters as they are on rank 0 and as zeros elsewhere.

    The zeros pass the gradient through unchanged (_RankZeroOnly): the output's gradient is the
    same on every rank (moe_tp_experts' all-reduce has an identity backward), so every rank's
    parameter gets the whole gradient, as at TP=1, with no collective. The wrapper sits inside
    module.forward, so tp-invariant-linear's experts forward (which adds the bias once itself,
    after its tree) replaces it rather than running under it.
    """
    import torch

    keep = mesh.get_local_rank() == 0
    inner = module.forward

    class _RankZeroOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p):
            return p.clone() if keep else torch.zeros_like(p)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def forward(*args, **kwargs):
        saved = {p: module._parameters[p] for p in pnames}
        module._parameters.update({p: _RankZeroOnly.apply(v) for p, v in saved.items()})
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


def _grad_allreduce_now(module, mesh) -> None:
    """transformers' ReplicatedWithGradAllReduce, with its grad hooks registered now.

    transformers registers the all-reduce of a per-head norm's (q_norm/k_norm) weight grad at
    the first forward, i.e. after tpdiag's probes - so the probe would record the rank-partial
    grad, a false rank-inconsistent replica. Registered here, before any probe, the reduction
    (the same single all_reduce) runs first and the probe sees the grad the optimizer uses.
    """
    import torch.distributed as dist

    group = mesh.get_group()

    def reduce(p):
        from tpdiag.fixes import registry
        from tpdiag.fixes.norm import HEAD_NORM_FIXED

        # under invariant-norm-grad (the fix that takes this over) the norm's own backward
        # already summed the heads of every rank in tree order; reducing again would count them
        # TP times. A norm the fix left stock (another formula: Gemma's) is reduced here still
        if not (registry.takes_over("head-norm-grad-reduce") and getattr(module, HEAD_NORM_FIXED, False)):
            dist.all_reduce(p.grad, group=group)

    for p in module.parameters(recurse=False):
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(reduce)


SHARDED_HEAD = "sharded-head"
# What transformers' head plans may say for the LM head; the sharded-head variant replaces any of
# them (or no entry) by "colwise". colwise_gather_output and colwise_rep all-gather the logits, so
# every rank holds the whole [tokens, vocab] (and its loss an fp32 copy of it: 18.6 GiB at 32768
# tokens x 151936); "colwise" keeps this rank's vocab shard (Shard(-1)), as the built-in models'
# head does, and tpdiag's loss and logprobs are then vocab-parallel (torch's loss_parallel, or
# invariant-vocab-softmax under the fix) - the whole vocab is never on one rank.
_HEAD_STYLES = (None, "colwise_gather_output", "colwise_rep", "colwise")


def tp_plan_of(model, variant: str = "stock") -> dict:
    """The model's transformers TP plan {fqn pattern: style name} as torch ParallelStyles.

    Module entries map to a style; entries naming a parameter ('...experts.gate_up_proj')
    are folded into their module's entry, since parallelize_module addresses modules only.
    variant 'sharded-head': the LM head column-parallel with local vocab-shard logits
    (transformers' own "colwise" style; see SHARDED_HEAD), every other entry as transformers has it.
    """
    plan = dict(getattr(model, "tp_plan", None) or {})
    if variant == SHARDED_HEAD:
        plan = _shard_head(model, plan)
    elif variant != "stock":
        raise BadInput(f"plan variant {variant!r}: hf: models offer stock (the config's own TP plan) "
                       f"or {SHARDED_HEAD} (the LM head's logits left as vocab shards)")
    generic_modules = {_generic(n) for n, _ in model.named_modules()}
    generic_params = {_generic(n) for n, _ in model.named_parameters()}
    entries: dict[str, list] = {}  # module pattern -> [module style, {param: style}], plan order
    for key, style in plan.items():
        if key in generic_modules:
            entries.setdefault(key, [None, {}])[0] = style
            continue
        owner, _, pname = key.rpartition(".")
        if owner in generic_modules and key in generic_params:
            entries.setdefault(owner, [None, {}])[1][pname] = style
        # else: a rule that matches nothing in this model (gemma4's 'layers.*.experts' when the
        # tiny config has no MoE: no module and no parameter of that name); transformers only
        # warns about those
    return _styles(model, entries)


def _styles(model, entries: dict) -> dict:
    tied: dict = {}
    config = text_config(model.config) if getattr(model, "config", None) is not None else None
    return {key: style if params is None else hf_style(style, params, tied, config)
            for key, (style, params) in entries.items()}


def named_styles(model, plan: dict, where: str) -> dict:
    """A user's plan whose values may be transformers' style names (`model.tp_plan` of a
    `from_pretrained` model, `"colwise"`, `"rowwise"`, ...) with every name made the torch
    ParallelStyle that applies transformers' own registered style, as for an `hf:` model; torch
    ParallelStyles are kept as they are. transformers' `module.param` entries (the packed
    experts' `gate_up_proj`) go to their module's style, since parallelize_module addresses
    modules. A name transformers does not register is refused in one line (BadInput)."""
    import fnmatch

    if not any(isinstance(v, str) for v in plan.values()):
        return plan
    modules = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters()]
    own = dict(getattr(model, "tp_plan", None) or {})
    entries: dict[str, list] = {}  # pattern -> [style, {param: name} or None for a torch style]
    for key, style in plan.items():
        if isinstance(style, str):
            _known(style, key, where)
        owner, _, pname = key.rpartition(".")
        on_module = any(fnmatch.fnmatchcase(n, key) for n in modules)
        on_param = isinstance(style, str) and not on_module and any(fnmatch.fnmatchcase(n, key) for n in params)
        if isinstance(style, str) and not (on_module or on_param) and own.get(key) == style:
            # an entry of the model's own class-wide plan for a module this config does not build
            # (Qwen3-Next's dense `mlp.gate_proj` when every layer is MoE): transformers skips it
            # too. Any other entry that matches nothing is still refused (runner/build._check_plan).
            continue
        if not on_param:
            if key in entries and entries[key][0] is not None:
                raise BadInput(f"{where}: plan entry {key!r} is given twice")
            e = entries.setdefault(key, [None, {} if isinstance(style, str) else None])
            if not isinstance(style, str) and e[1]:
                raise BadInput(f"{where}: plan entry {key!r} is a torch ParallelStyle and its parameters "
                               f"have transformers style names ({', '.join(e[1])}): give the module one kind")
            e[0], e[1] = style, e[1] if isinstance(style, str) else None
            continue
        e = entries.setdefault(owner, [None, {}])
        if e[1] is None:
            raise BadInput(f"{where}: plan entry {key!r} names a parameter of {owner!r}, whose entry is a "
                           "torch ParallelStyle: give the module one kind")
        e[1][pname] = style
    return _styles(model, entries)


def _known(name: str, key: str, where: str) -> None:
    if name in ("colwise_gather_input", ONCE):
        return
    # the registry is filled when these modules are imported (from_pretrained may not have)
    import transformers.distributed.expert_parallel  # noqa: F401
    import transformers.distributed.tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    if name not in ALL_PARALLEL_STYLES:
        import difflib

        close = difflib.get_close_matches(name, list(ALL_PARALLEL_STYLES), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise BadInput(f"{where}: plan entry {key!r}: {name!r} is not a transformers TP style name; {hint}"
                       "(a plan's values are torch ParallelStyles or the style names of transformers' "
                       "tp_plan: colwise, rowwise, colwise_gather_output, embedding_rowwise, ...)")


def _shard_head(model, plan: dict) -> dict:
    """`plan` with the LM head (get_output_embeddings) as transformers' "colwise" style."""
    import torch

    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    name = next((n for n, m in model.named_modules() if head is not None and m is head), None)
    if not isinstance(head, torch.nn.Linear) or not name:
        raise BadInput(f"plan variant {SHARDED_HEAD}: {type(model).__name__} has no nn.Linear LM head "
                       "(get_output_embeddings) to shard; use the stock plan")
    key = _generic(name)
    if plan.get(key) not in _HEAD_STYLES:
        raise BadInput(f"plan variant {SHARDED_HEAD}: the LM head {name!r} has the style "
                       f"{plan[key]!r}, not a column-parallel one; use the stock plan")
    # the head keeps its place in the plan (its entry comes first in transformers' plans)
    return {**plan, key: "colwise"}


def _generic(name: str) -> str:
    # Layer numbers become '*', as in transformers' plans ('model.layers.*.mlp.up_proj').
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def divisors_of(config) -> dict[str, int]:
    """Dimensions a degree must divide: heads (HF attention reads local head counts from the
    shard's shape) and vocab/intermediate (gather needs equal shards on every rank)."""
    c = text_config(config)
    out = {}
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size",
                "intermediate_size"):
        v = getattr(c, key, None)
        if isinstance(v, int):
            out[key] = v
    return out
