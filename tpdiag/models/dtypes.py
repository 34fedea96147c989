"""The dtype each parameter and buffer of a model holds in a run of dtype D: the user's model as
the user loads it, not `model.to(D)`.

`nn.Module.to(D)` casts every floating tensor, buffers included: RoPE's `inv_freq` (and the
built-in presets' rotary tables) become bf16, which no user's model holds - transformers'
`from_pretrained(dtype=bf16)` keeps them float32, and logits then differ in the bf16 last bits
at every position. So the cast is per tensor, by a rule per model source:

- `hf:` - what `from_pretrained(DIR, dtype=D)` gives (tpdiag.models.hf.load_dtypes): each tensor
  in the dtype it has in the model transformers builds under the default dtype D (buffers it
  computes in float32 stay float32), the model's `_keep_in_fp32_modules` (fp16) and
  `_keep_in_fp32_modules_strict` (fp16, bf16) patterns in float32. tpdiag's own seeded init (no
  weights) runs in float32 and is then cast by this rule: what `from_pretrained(dtype=D)` gives
  for that init saved as a float32 checkpoint.
- built-in presets: parameters in D, the rotary tables float32 (computed in float64, rounded
  once, as a trainer keeps them).
- `py:` - a model that already holds a floating parameter in D was built for the run: nothing is
  recast. Otherwise `nn.Module.to(D)`'s rule (every floating tensor), the one tpdiag always used.

A rule is `fn(name, tensor) -> torch.dtype`: the dtype `tensor` (the model's tensor `name`, as
built, float32 for presets and hf:) has in the run.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

DtypeRule = Callable[[str, torch.Tensor], torch.dtype]


def module_to(dtype: torch.dtype) -> DtypeRule:
    """nn.Module.to(dtype)'s rule: every floating tensor to dtype."""
    return lambda name, t: dtype if t.is_floating_point() else t.dtype


def builtin_rule(dtype: torch.dtype) -> DtypeRule:
    """Parameters in dtype; buffers (the rotary tables) as built."""
    return lambda name, t: dtype if isinstance(t, nn.Parameter) and t.is_floating_point() else t.dtype


def py_rule(model: nn.Module, dtype: torch.dtype) -> DtypeRule:
    floats = [p for p in model.parameters() if p.is_floating_point()]
    if any(p.dtype == dtype for p in floats):
        return lambda name, t: t.dtype
    return module_to(dtype)


def rule_for(kind: str, model: nn.Module, dtype: torch.dtype) -> DtypeRule:
    """The run's dtype rule for a model of source `kind` ('builtin', 'hf', 'py'), built as tpdiag
    builds it (on meta or materialised)."""
    if kind == "builtin":
        return builtin_rule(dtype)
    if kind == "hf":
        from tpdiag.models.hf import load_dtypes

        return load_dtypes(model, dtype)
    return py_rule(model, dtype)


@torch.no_grad()
def cast(model: nn.Module, rule: DtypeRule) -> nn.Module:
    """Every parameter and buffer of `model` in the dtype `rule` gives it; a tensor shared by
    several modules (tied weights) is cast once and stays shared; a parameter keeps its identity
    (as nn.Module.to does)."""
    done: dict[int, torch.Tensor] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for slot in ("_parameters", "_buffers"):
            table = getattr(mod, slot)
            for key, t in list(table.items()):
                if t is None:
                    continue
                if id(t) in done:
                    table[key] = done[id(t)]
                    continue
                want = rule(f"{prefix}.{key}" if prefix else key, t)
                if t.dtype != want:
                    if isinstance(t, nn.Parameter):
                        t.data = t.data.to(want)
                    else:
                        table[key] = t.to(want)
                done[id(t)] = table[key]
                done[id(table[key])] = table[key]
    return model


def buffer_dtypes(model: nn.Module) -> dict[str, str]:
    """{buffer name: dtype} of the floating buffers (what the manifest and docs report)."""
    return {n: str(b.dtype).replace("torch.", "") for n, b in model.named_buffers()
            if b is not None and b.is_floating_point()}


def param_dtypes(model: nn.Module) -> dict[str, int]:
    """{dtype: how many floating parameters hold it}."""
    out: dict[str, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            k = str(p.dtype).replace("torch.", "")
            out[k] = out.get(k, 0) + 1
    return out


# the attribute to_run_dtype leaves on a py: model it recast: {built, ran, note} (recast_note)
RECAST = "_tpdiag_recast"


def recast_note(kind: str, model: nn.Module, dtype: torch.dtype) -> dict | None:
    """{built, ran, note} for a py: model whose FUNC built its floating parameters in another dtype
    than the run's (a trainer's `from_pretrained(..., dtype=torch.bfloat16)` under the default
    --dtype float32): py_rule recasts every one, so the run is not the model the user's code
    computes with - said, as an hf: checkpoint's saved dtype is (checkpoint_dtype)."""
    if kind != "py":
        return None
    built = param_dtypes(model)
    name = str(dtype).replace("torch.", "")
    if not built or name in built:
        return None
    most = max(built, key=built.get)
    return {"built": most, "ran": name, "note": (
        f"your py: model's parameters are {most} as FUNC builds them ({built[most]} of "
        f"{sum(built.values())}) and this run computes in {name} (--dtype): tpdiag cast the model to {name}, "
        f"so it is not the model your code runs - add --dtype {most} to run it as FUNC builds it")}


def to_run_dtype(kind: str, model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` (whole, as built) with every tensor in the run's dtype by its source's rule."""
    recast = recast_note(kind, model, dtype)
    cast(model, rule_for(kind, model, dtype))
    if recast:
        model.__dict__[RECAST] = recast
    mark_config(kind, model, dtype)
    return model


def mark_config(kind: str, model: nn.Module, dtype: torch.dtype) -> None:
    """from_pretrained(dtype=D) leaves config.dtype = D (model code may read it)."""
    cfg = getattr(model, "config", None)
    if kind == "hf" and cfg is not None and hasattr(cfg, "dtype"):
        cfg.dtype = dtype


def saved_dtype(hf_dir: str) -> str | None:
    """The dtype an hf: checkpoint says it was saved in (config.json `dtype`, before transformers 5
    `torch_dtype`), e.g. "bfloat16"; None when it says none. An engine loading it with
    `dtype="auto"` (vLLM's default) computes in it, whatever --dtype the trainer side runs."""
    import json
    import os

    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    saved = (cfg.get("dtype") or cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    return saved.replace("torch.", "") if isinstance(saved, str) and saved != "auto" else None


def checkpoint_dtype(spec_text: str, dtype: str) -> dict | None:
    """{saved, ran, note} for an hf: checkpoint whose config.json names the dtype it was saved in
    (None for other models, or a checkpoint that names none); note is None where they agree.
    transformers >= 5 loads a checkpoint as saved unless told otherwise (`dtype="auto"` is
    from_pretrained's default), and so do engines (vLLM's `dtype="auto"`): a bf16 checkpoint run
    here in float32 is not the model the user's code computes with."""
    from tpdiag.models.spec import parse_spec

    spec = parse_spec(spec_text)
    saved = saved_dtype(spec.value) if spec.kind == "hf" else None
    if saved is None:
        return None
    note = None
    if saved != dtype:
        note = (f"the checkpoint is saved in {saved} (its config.json) and this run computes in {dtype} "
                f"(--dtype): `from_pretrained(DIR)` loads it in {saved} (transformers >= 5 loads as saved; "
                f"`dtype=torch.{dtype}` loads {dtype}), as an engine does - add --dtype {saved} to run the "
                "model as it is loaded")
    return {"saved": saved, "ran": dtype, "note": note}
