"""`hf:DIR`: a local Hugging Face causal LM, sharded by transformers' own TP styles
(tpdiag.models.hf_plan: the model's own `tp_plan` - the config's `base_model_tp_plan` prefixed
with the base model's name, plus the head's `_tp_plan`, what `from_pretrained(tp_plan="auto")`
applies).

The model is built on the meta device and materialised on the rank's device: safetensors
weights read straight onto it if the directory has them, else each module initialised by
transformers' own `_init_weights` from an RNG seeded by (seed, module fqn)
(tpdiag.models.meta_init): the same weights at every degree. At TP > 1 the plan is applied on
meta first and each module is materialised and cut to its shard on its own
(tpdiag.models.shard_init, via tpdiag.models.build.build_sharded); at TP = 1, or where that
route does not apply, the whole model is materialised, then `parallelize_module` shards it.
Every weight is initialised as a full tensor before it is cut (transformers' own TP loading
initialises per shard, which would give different random weights per degree).

Plan variants: `stock` (that plan) and `sharded-head` (the same with the LM head's logits left as
each rank's vocab shard, so the loss runs vocab-parallel: tpdiag.models.hf_plan.SHARDED_HEAD).

transformers is imported lazily: `import tpdiag` stays cheap.
"""
from __future__ import annotations

import glob
import os

from tpdiag.errors import BadInput, EnvironmentProblem
from tpdiag.models.hf_plan import divisors_of, text_config, tp_plan_of

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


def _config(path: str, layers: int = 0):
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
    from tpdiag.models import plans_hf

    plans_hf.resolve(config, path)  # tpdiag's plan where transformers has none (or a broken one)
    tc = text_config(config)
    # every dropout probability the config holds, by whatever name its modeling code reads
    # (Seed-OSS's residual_dropout 0.1, Phi's resid_pdrop/embd_pdrop, ...): with only the three
    # common names zeroed, a Seed-OSS step ran residual dropout - not the model a plain forward
    # computes (0.24 off from_pretrained's logits), and a mask drawn over a sharded shape differs
    # per degree by construction
    for key, value in list(vars(tc).items()):
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(tc, key, 0.0)
    if layers:  # --layers N: the first N decoder layers (tpdiag/models/slice.py)
        from tpdiag.models.slice import slice_text_config

        slice_text_config(tc, layers)
    return config


def load_model(path: str, device=None, seed: int | None = None, layers: int = 0):
    """The whole model: safetensors weights if present, else a random init.

    device None: built on the CPU, random init from the global RNG the caller seeded (every
    rank builds the same). With a device: built on the meta device and materialised there -
    safetensors loaded straight onto it, or each module initialised by its own
    `_init_weights` from an RNG seeded by (seed, module fqn) (tpdiag.models.meta_init)."""
    config = _config(path, layers)  # first: it says so when transformers is missing
    import torch
    from transformers import AutoModelForCausalLM

    has_st = bool(glob.glob(os.path.join(path, "*.safetensors")))
    with _build_errors(path):
        built = meta_build(path, config, layers) if device is not None else None
        if built is not None:
            model, mapping = built
            materialize_hf(model, device, 0 if seed is None else seed, frozenset(mapping or ()))
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
    _generation_config(model, path)
    model.train()
    return model


def _generation_config(model, path: str) -> None:
    """The checkpoint's generation_config.json on the model, as from_pretrained puts it there: generate()
    merges it into every call (a Qwen3 checkpoint's top_k=20, temperature=0.6), so `rollout --sampling`
    and the decode's pad token read it. A model built from its config alone got the config's defaults
    (top_k=50: another sampler than the user's generate())."""
    f = os.path.join(path, "generation_config.json")
    can = getattr(model, "can_generate", None)
    if not os.path.isfile(f) or not callable(can) or not can():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - an unusable file is a bad spec, in one line
        raise BadInput(f"--model hf:{path}: generation_config.json not usable by transformers: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


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


def meta_build(path: str, config=None, layers: int = 0):
    """(the model built on the meta device, {tensor name: (file, key)} of its safetensors or None
    when the directory has none), or None when the checkpoint's names are not the model's own
    (it must be loaded with from_pretrained: tpdiag.models.weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tpdiag.models import weights

    config = _config(path, layers) if config is None else config
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
    skip = None
    if layers:  # the dropped layers' tensors are not read
        from tpdiag.models.slice import dropped_key

        skip = lambda key: dropped_key(key, layers)  # noqa: E731
    mapping = weights.plan(model, files, getattr(model, "base_model_prefix", ""), skip=skip)
    return None if mapping is None else (model, mapping)


def attention_of(path: str, layers: int = 0) -> str:
    """The attention implementation transformers picks for hf:DIR (what a world runs under
    `--attention auto`: SDPA for most models, eager for one that has no SDPA path, as Gemma2), read
    from a build on the meta device (no memory, no init)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(path, layers)
    with _build_errors(path):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    return str(model.config._attn_implementation)


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
    from tpdiag.models.slice import whole_depth

    tc = text_config(model.config)

    def rule(fqn, module):
        with whole_depth(tc):  # a --layers slice: initialised as the whole model's first layers
            owner[id(module)]._init_weights(module)
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if own and any(bool(p.isnan().any()) for p in own) and hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return rule


def init_guard():
    from transformers import initialization as hf_init

    return hf_init.guard_torch_init_functions()


def materialize_hf(model, device, seed: int, loaded: frozenset[str] = frozenset()) -> None:
    """A meta-built transformers model on `device`, every module initialised by init_rule;
    `loaded`: the tensors a checkpoint fills next (no rule need fill them: Apertus' XIELU
    alpha_p/alpha_n are set in the activation's __init__, lost on meta)."""
    from tpdiag.models.meta_init import materialize

    with init_guard():
        materialize(model, device, seed, init_rule(model), loaded)


def load_hf_target(path: str, variant: str = "stock", device=None, seed: int | None = None, layers: int = 0,
                   need_plan: bool = True):
    """need_plan False: a model without a TP plan is built with an empty one (a TP=1-only caller:
    rollout's own TP=1 model)."""
    _check_variant(variant)
    return _target(path, load_model(path, device, seed, layers), variant, need_plan)


def meta_hf_target(path: str, variant: str = "stock", layers: int = 0):
    """(the Target with its model still on the meta device, the safetensors mapping or None), or
    None when the checkpoint must go through from_pretrained (tpdiag.models.build's sharded
    build: the plan is applied on meta, then each module is materialised)."""
    _check_variant(variant)
    built = meta_build(path, layers=layers)
    if built is None:
        return None
    model, mapping = built
    model.train()
    return _target(path, model, variant), mapping


def _check_variant(variant: str) -> None:
    from tpdiag.models.plans import HF_VARIANTS

    if variant not in HF_VARIANTS:
        raise BadInput(f"plan variant {variant!r}: hf: models offer {', '.join(HF_VARIANTS)} "
                       "(stock: the config's own base_model_tp_plan; sharded-head: the same with the "
                       "LM head's logits left as vocab shards)")


def _target(path: str, model, variant: str = "stock", need_plan: bool = True):
    from tpdiag.models.target import Target

    plan = tp_plan_of(model, variant)
    if not plan and need_plan:
        raise BadInput(f"--model hf:{path}: {type(model).__name__} has no tensor-parallel plan "
                       "(no base_model_tp_plan in its config); it cannot run at TP > 1")
    tc = text_config(model.config)
    return Target(model=model, plan=plan, vocab_size=int(tc.vocab_size), divisors=divisors_of(tc))


def load_dtypes(model, dtype):
    """The dtype rule (tpdiag.models.dtypes) of `from_pretrained(DIR, dtype=dtype)` for `model`
    (built by tpdiag in float32: meta, materialised or sharded - the names are the same).

    transformers builds the model on meta under the default dtype `dtype` (its
    `get_init_context`), so a buffer it computes explicitly in float32 (RoPE's inv_freq) stays
    float32; each checkpoint tensor is then loaded in that tensor's dtype, or float32 where the
    model's `_get_dtype_plan(dtype)` (its keep-in-fp32 module patterns) matches the name
    (core_model_loading: `re.search` over the state-dict key). The same two steps here, on a
    meta twin built with `from_config(dtype=dtype)`."""
    import copy
    import re

    import torch
    from transformers import AutoModelForCausalLM

    if dtype == torch.float32:
        return lambda name, t: t.dtype
    config = copy.deepcopy(model.config)
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    want = {n: t.dtype for n, t in list(twin.named_parameters(remove_duplicate=False))
            + list(twin.named_buffers(remove_duplicate=False))}
    plan = twin._get_dtype_plan(dtype) if hasattr(twin, "_get_dtype_plan") else {}
    keep = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in plan)) if plan else None
    persistent = set(twin.state_dict().keys())
    del twin

    def rule(name, t):
        if not t.is_floating_point():
            return t.dtype
        if keep is not None and name in persistent and keep.search(name):
            return plan[next(p for p in plan if re.search(p.replace("*", ".*"), name))]
        return want.get(name, dtype)

    return rule
