"""Refuse, before any world starts, a model that TP cannot split the way it is asked to.

- hf:DIR: transformers' `base_model_tp_plan` for the config (read in the parent; no weights), or
  tpdiag's own where transformers has none or a broken one (models/plans_hf.py). With none, TP > 1
  would shard nothing but the LM head (or nothing at all): a "TP=2" run that splits only the head
  is not the model at TP=2, so it is refused rather than reported.
- py:: the Target is built on the meta device (no memory, no init) to read its plan: a plan
  entry matching no module, or a degree not dividing a dimension the plan shards (a
  column-parallel Linear's outputs, a row-parallel one's inputs, an embedding's vocab) or one
  the Target lists in `divisors`. A py: plan is the user's own, so an empty one or one that
  splits only the head is run as given (an empty plan is the replicated control: bitwise equal).
- tpdiag.capture(model, plan=...): the same plan checks when the capture starts, before anything
  is recorded (check_model_plan): entries ('module' or 'module.param' globs) that match nothing,
  and a TP group size that does not divide a dimension a DTensor weight is split along. The user
  sharded the model (a capture applies no plan), so there is no "no plan" refusal there.
"""
from __future__ import annotations

import fnmatch
import functools

from tpdiag.errors import BadInput
from tpdiag.models.plans_hf import splits_nothing


@functools.lru_cache(maxsize=8)
def hf_base_plan(path: str) -> tuple[str, dict | None]:
    """(model_type, base_model_tp_plan or None) of a hf:DIR, from transformers' config class."""
    from tpdiag.models.hf import _transformers

    _transformers()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any config problem is a bad spec, in one line
        # the words every rank would raise (models/hf.py _config), here before TP=1 and its rerun
        # ran and every world failed with them (an unknown model_type, custom code)
        raise BadInput(f"--model hf:{path}: config.json not usable by transformers: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    plans = [getattr(config, "base_model_tp_plan", None)]
    if hasattr(config, "get_text_config"):
        plans.append(getattr(config.get_text_config(), "base_model_tp_plan", None))
    plan = next((p for p in plans if p), None)
    model_type = str(getattr(config, "model_type", ""))
    from tpdiag.models import plans_hf

    if not plans_hf.user_plan(path):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        plan = plans_hf.table_plan(model_type, plan, text) or plan
    return model_type, plan


def _py_target(spec, variant: str):
    from tpdiag.models.meta_fills import meta_device
    from tpdiag.models.spec import load_target

    try:
        with meta_device():
            return load_target(spec, variant)
    except BadInput:
        raise
    except Exception:  # noqa: BLE001 - code that cannot build on meta: the world checks instead
        return None


def _sharded_dims(model, plan: dict, global_only: bool = False) -> dict[str, int]:
    """{'<module> <what>': size} of every dimension the plan splits across ranks.

    global_only: read only weights whose whole shape is known (DTensors, or a model not yet
    sharded); a plain weight of an already-sharded model holds the local shape."""
    import torch

    out = {}
    for name, mod in model.named_modules():
        style = next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), None)
        w = getattr(mod, "weight", None)
        if style is None or w is None or getattr(w, "ndim", 0) != 2:
            continue
        if global_only and not hasattr(w, "placements"):
            continue
        kind = type(style).__name__
        is_embed = isinstance(mod, torch.nn.Embedding)
        if kind == "ColwiseParallel":
            out[f"{name} {'embedding dim' if is_embed else 'out_features'}"] = int(w.shape[1 if is_embed else 0])
        elif kind == "RowwiseParallel":
            out[f"{name} {'vocab' if is_embed else 'in_features'}"] = int(w.shape[0 if is_embed else 1])
    return out


# Where a user's attention module keeps its head counts (torchtitan's n_heads / n_kv_heads,
# nanoGPT's n_head, transformers-style num_attention_heads / num_key_value_heads ...). The plan
# splits a projection's out_features, and a degree can divide those while not dividing the heads
# (4 heads of 16: 64 columns split 16 ways is 4 columns a rank, a quarter of a head): every world
# then failed in the user's view(..., head_dim) with a shape error instead of one line here.
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads",
              "n_kv_heads", "num_kv_heads", "n_kv_head", "num_key_value_heads")


def _style_of(plan: dict, name: str):
    return next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), None)


def _head_dims(model, plan: dict, global_only: bool = False) -> dict[str, int]:
    """{'<module> <attr>': heads} of every module holding a head count whose own children the
    plan splits; for a module with a head_dim and no count, {'<child> out_features/head_dim':
    heads} of each column-parallel child. Only direct children: a head count two levels up (a
    block's) may belong to an attention the plan leaves whole (an MLP-only plan is not refused)."""
    out = {}
    for name, mod in model.named_modules():
        split = []
        for c, child in mod.named_children():
            fqn = f"{name}.{c}" if name else c
            w = getattr(child, "weight", None)
            if getattr(w, "ndim", 0) == 2 and _style_of(plan, fqn) is not None \
                    and not (global_only and not hasattr(w, "placements")):
                split.append((fqn, child, w))
        if not split:
            continue
        who = name or type(model).__name__
        counts = {f"{who} {a}": v for a in HEAD_ATTRS
                  if isinstance(v := getattr(mod, a, None), int) and not isinstance(v, bool) and v > 0}
        out.update(counts)
        hd = getattr(mod, "head_dim", None)
        # no count kept (transformers-style: config and head_dim): each split projection's heads
        if counts or not (isinstance(hd, int) and not isinstance(hd, bool) and hd > 0):
            continue
        for fqn, child, w in split:
            if type(_style_of(plan, fqn)).__name__ == "ColwiseParallel" and not isinstance(child, _embedding()) \
                    and int(w.shape[0]) % hd == 0:
                out[f"{fqn} heads (out_features {int(w.shape[0])} / head_dim {hd})"] = int(w.shape[0]) // hd
    return out


def _embedding():
    import torch

    return torch.nn.Embedding


def valid_degrees(sizes) -> list[int]:
    """Every degree that divides all of `sizes` (up to 64: no more ranks than that in one world)."""
    import math

    g = math.gcd(*sizes) if sizes else 64
    return [n for n in range(1, min(g, 64) + 1) if g % n == 0]


def check_plan(spec, degrees, variant: str = "stock") -> None:
    """Raise BadInput if some degree > 1 cannot split this model (see the module docstring)."""
    tp = [d for d in degrees if d > 1]
    if not tp:
        return
    if spec.kind == "hf":
        model_type, plan = hf_base_plan(spec.value)
        # a plan that splits only the embedding leaves every layer replicated: no more a TP model
        # than none (tpdiag's table, models/plans_hf.py, already filled in what it knows)
        if model_type and splits_nothing(plan):
            # an embedding-only plan (DiffLlama's embed_tokens) is a plan: "no plan" misstated it
            what = (f"'s tensor-parallel plan in transformers splits only {', '.join(plan)} (base_model_tp_plan: "
                    "no layer is split; at most the LM head would be too)" if plan else
                    " has no tensor-parallel plan in transformers (no base_model_tp_plan; at most the LM head "
                    "would be split)")
            raise BadInput(f"--model hf:{spec.value}: {model_type}{what}, "
                           f"so TP={tp[0]} would not be the model at TP={tp[0]}; give it a plan as "
                           "base_model_tp_plan in its config.json or as a py: target (docs/models.md)")
        return
    if spec.kind != "py":
        return
    t = _py_target(spec, variant)
    if t is None:
        return
    check_model_plan(t.model, t.plan, tp, f"--model py:{spec.value}", f"py:{spec.value}",
                     t.divisors)
    if t.inputs is None:
        check_vocab(t.model, t.vocab_size, f"--model py:{spec.value}")


def check_vocab(model, vocab_size: int, who: str) -> None:
    """Refuse a Target.vocab_size that no nn.Embedding of the model has rows for: tpdiag's random
    tokens are drawn from [0, vocab_size), and every world failed with `IndexError: index out of
    range in self` inside the user's forward, which names neither the vocab_size nor the fix."""
    import torch

    rows = {n: m.num_embeddings for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    if rows and max(rows.values()) < vocab_size:
        name, n = max(rows.items(), key=lambda kv: kv[1])
        raise BadInput(f"{who}: Target.vocab_size is {vocab_size} but the model's largest embedding, "
                       f"{name}, has {n} rows: the random token ids tpdiag draws from [0, {vocab_size}) "
                       "would index past it; set vocab_size to the model's vocabulary (or give "
                       "Target.inputs that draws the tokens)")


def check_model_plan(model, plan: dict, degrees, who: str, of: str, divisors: dict | None = None,
                     params: bool = False, global_only: bool = False, flag: str = "--tp") -> None:
    """Refuse a plan entry that matches no module (params: or no 'module.param') and a degree
    that does not divide a dimension the plan shards, in one line each. who/of name the model
    in the messages ('--model py:F:T' / 'py:F:T'); flag names the degree's source."""
    names = [n for n, _ in model.named_modules()]
    if params:
        names += [n for n, _ in model.named_parameters()]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise BadInput(f"{who}: plan entry {pattern!r} matches no module of the model")
    dims = {**_sharded_dims(model, plan, global_only), **_head_dims(model, plan, global_only),
            **dict(divisors or {})}
    for d in degrees:
        if d <= 1:
            continue
        bad = [f"{k}={v}" for k, v in dims.items() if v % d]
        if bad:
            raise BadInput(f"{flag} {d}: does not divide {', '.join(bad[:3])}"
                           f"{' (and more)' if len(bad) > 3 else ''} of {of}; degrees that divide every "
                           f"size split: {', '.join(map(str, valid_degrees(list(dims.values()))))}")
