"""`hf:DIR`: a local Hugging Face causal LM, sharded by transformers' own TP styles.

The model is built on the meta device and materialised on the rank's device: safetensors
weights read straight onto it if the directory has them, else each module initialised by
transformers' own `_init_weights` from an RNG seeded by (seed, module fqn)
(tpdiag.models.meta_init): the same weights at every degree. At TP > 1 the plan is applied on
meta first and each module is materialised and cut to its shard on its own
(tpdiag.models.shard_init, via tpdiag.models.build.build_sharded); at TP = 1, or where that
route does not apply, the whole model is materialised, then `parallelize_module` shards it. The plan is the model's own `tp_plan`
(the config's `base_model_tp_plan` prefixed with the base model's name, plus the head's
`_tp_plan`: what `from_pretrained(tp_plan="auto")` applies), with each style name mapped to the
very `TensorParallelLayer` object transformers registers for it and wrapped as a torch
`ParallelStyle`. So the numerics tpdiag diagnoses are transformers' TP, not a re-implementation,
while every weight is still initialised as a full tensor before it is sharded (transformers'
own TP loading initialises per shard, which would give different random weights per degree).

transformers is imported lazily: `import tpdiag` stays cheap.
"""
from __future__ import annotations

import glob
import os
import re

from tpdiag.errors import BadInput, EnvironmentProblem

# tpdiag reads a style's layout from its class name (tpdiag.records.styles.style_label), so each
# wrapper class carries the torch name of the layout the transformers style implements.
_LAYOUT_NAMES = {
    "ColwiseParallel": "ColwiseParallel",
    "PackedColwiseParallel": "ColwiseParallel",
    "RowwiseParallel": "RowwiseParallel",
    "PackedRowwiseParallel": "RowwiseParallel",
    "SequenceParallel": "SequenceParallel",
}
_CLASSES: dict[str, type] = {}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise EnvironmentProblem("--model hf:DIR needs transformers; install it with "
                                 "pip install 'transformers>=5,<6' (or tpdiag[hf])") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise EnvironmentProblem(f"--model hf:DIR needs transformers>=5 (its DTensor TP styles); "
                                 f"found {transformers.__version__}")
    try:
        import transformers.distributed.parallel_utils  # noqa: F401
    except ImportError:
        # seen with 5.17 on the GPU machines; 5.23 has it
        raise EnvironmentProblem(f"--model hf:DIR needs transformers.distributed.parallel_utils "
                                 f"(transformers 5.23 has it); found {transformers.__version__}") from None
    return transformers


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
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    layout = _layout_name(ALL_PARALLEL_STYLES[name]) if name else "HFParamStyle"
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
        # Exposed for tpdiag's layout labels ('colwise' vs 'colwise-gathered').
        self.input_layouts = getattr(inner, "input_layouts", None)
        self.output_layouts = getattr(inner, "output_layouts", None)

    @staticmethod
    def _style(name: str):
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

        return ALL_PARALLEL_STYLES[name]

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
        if self.hf_name == "replicated_with_grad_allreduce":
            _grad_allreduce_now(module, mesh)
        elif self.hf_name is not None:
            if self.hf_name in _NEEDS_CONFIG:
                if self.config is None:
                    raise BadInput(f"transformers style {self.hf_name!r} on {type(module).__name__} "
                                   "needs the model's config (build the plan with tp_plan_of(model))")
                module.config = self.config
            self._style(self.hf_name).install_forward(module, mesh)
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
        from tpdiag.fixes import state

        # under invariant-norm-grad the norm's own backward already summed the heads of
        # every rank in tree order; reducing again would count them TP times
        if not state.active("invariant-norm-grad"):
            dist.all_reduce(p.grad, group=group)

    for p in module.parameters(recurse=False):
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(reduce)


def tp_plan_of(model) -> dict:
    """The model's transformers TP plan {fqn pattern: style name} as torch ParallelStyles.

    Module entries map to a style; entries naming a parameter ('...experts.gate_up_proj')
    are folded into their module's entry, since parallelize_module addresses modules only.
    """
    plan = dict(getattr(model, "tp_plan", None) or {})
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
    tied: dict = {}
    config = text_config(model.config) if getattr(model, "config", None) is not None else None
    return {key: hf_style(style, params, tied, config) for key, (style, params) in entries.items()}


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


def _config(path: str):
    transformers = _transformers()
    from transformers import AutoConfig

    # Every rank loads: no progress bars or load reports in the compare's terminal.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any config problem is a bad spec, in one line
        raise BadInput(f"--model hf:{path}: config.json not usable by transformers: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    # One training step: no KV cache to build, and no dropout (its RNG draws would differ
    # with the local shapes at each degree).
    config.use_cache = False
    tc = text_config(config)
    for key in ("attention_dropout", "hidden_dropout", "dropout"):
        if hasattr(tc, key):
            setattr(tc, key, 0.0)
    return config


def load_model(path: str, device=None, seed: int | None = None):
    """The whole model: safetensors weights if present, else a random init.

    device None: built on the CPU, random init from the global RNG the caller seeded (every
    rank builds the same). With a device: built on the meta device and materialised there -
    safetensors loaded straight onto it, or each module initialised by its own
    `_init_weights` from an RNG seeded by (seed, module fqn) (tpdiag.models.meta_init)."""
    config = _config(path)  # first: it says so when transformers is missing
    import torch
    from transformers import AutoModelForCausalLM

    has_st = bool(glob.glob(os.path.join(path, "*.safetensors")))
    with _build_errors(path):
        built = meta_build(path, config) if device is not None else None
        if built is not None:
            model, mapping = built
            materialize_hf(model, device, 0 if seed is None else seed)
            if mapping is not None:
                from tpdiag.models import weights

                weights.load(model, mapping, device)
        elif has_st:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                         trust_remote_code=False,
                                                         use_safetensors=True, local_files_only=True)
            if device is not None:
                model.to(device)
        else:
            _refuse_pickled(path)
            # The runner seeded the RNG: the full model's init is the same on every rank/degree.
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    model.train()
    return model


class _build_errors:
    """transformers' ValueError for a config it cannot build as a causal LM, as one BadInput."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, ValueError) and not issubclass(kind, BadInput):
            raise BadInput(f"--model hf:{self.path}: not a causal LM transformers can build: "
                           f"{str(e).splitlines()[0] if str(e) else kind.__name__}") from None
        return False


def _refuse_pickled(path: str) -> None:
    pickled = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
    if pickled:
        raise BadInput(f"--model hf:{path}: weights are pickled ({os.path.basename(pickled[0])}); "
                       "tpdiag loads safetensors only - convert them, or remove them for a random init")


def meta_build(path: str, config=None):
    """(the model built on the meta device, {tensor name: (file, key)} of its safetensors or None
    when the directory has none), or None when the checkpoint's names are not the model's own
    (it must be loaded with from_pretrained: tpdiag.models.weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tpdiag.models import weights

    config = _config(path) if config is None else config
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        _refuse_pickled(path)
    with _build_errors(path):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     trust_remote_code=False)
    if not files:
        return model, None
    # tensors the checkpoint lacks keep their seeded init (transformers would draw them too)
    mapping = weights.plan(model, files, getattr(model, "base_model_prefix", ""))
    return None if mapping is None else (model, mapping)


def init_rule(model):
    """The per-module rule of a meta-built transformers model (tpdiag.models.meta_init): the
    `_init_weights` of the module's nearest enclosing PreTrainedModel (what transformers' own
    init dispatches to), which also recomputes the rotary `inv_freq` buffers; a module whose
    parameters that rule leaves unfilled gets torch's own `reset_parameters()` - what a CPU
    `from_config` leaves there. Run it inside `init_guard()`."""
    from transformers import PreTrainedModel

    owner: dict[int, object] = {}

    def walk(mod, current):
        current = mod if isinstance(mod, PreTrainedModel) else current
        owner.setdefault(id(mod), current)
        for child in mod.children():
            walk(child, current)

    walk(model, model)

    def rule(fqn, module):
        owner[id(module)]._init_weights(module)
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if own and any(bool(p.isnan().any()) for p in own) and hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return rule


def init_guard():
    from transformers import initialization as hf_init

    return hf_init.guard_torch_init_functions()


def materialize_hf(model, device, seed: int) -> None:
    """A meta-built transformers model on `device`, every module initialised by init_rule."""
    from tpdiag.models.meta_init import materialize

    with init_guard():
        materialize(model, device, seed, init_rule(model))


def load_hf_target(path: str, variant: str = "stock", device=None, seed: int | None = None):
    _stock_only(variant)
    return _target(path, load_model(path, device, seed))


def meta_hf_target(path: str, variant: str = "stock"):
    """(the Target with its model still on the meta device, the safetensors mapping or None), or
    None when the checkpoint must go through from_pretrained (tpdiag.models.build's sharded
    build: the plan is applied on meta, then each module is materialised)."""
    _stock_only(variant)
    built = meta_build(path)
    if built is None:
        return None
    model, mapping = built
    model.train()
    return _target(path, model), mapping


def _stock_only(variant: str) -> None:
    if variant != "stock":
        raise BadInput(f"plan variant {variant!r}: hf: models offer only 'stock' "
                       "(the config's own base_model_tp_plan)")


def _target(path: str, model):
    from tpdiag.models.target import Target

    plan = tp_plan_of(model)
    if not plan:
        raise BadInput(f"--model hf:{path}: {type(model).__name__} has no tensor-parallel plan "
                       "(no base_model_tp_plan in its config); it cannot run at TP > 1")
    tc = text_config(model.config)
    return Target(model=model, plan=plan, vocab_size=int(tc.vocab_size), divisors=divisors_of(tc))
