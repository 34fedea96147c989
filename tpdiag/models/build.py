"""The full, unsharded Target of a world, built where it will run.

Built-in presets, `hf:` models and `py:` targets that opt in are built on the meta device and
materialised on the run's device (tpdiag.models.meta_init: each module initialised from an
RNG seeded by (seed, its fqn)), so no rank builds the whole model on its CPU first and every
degree holds the same weights. Other `py:` targets are built as before - FUNC() on the CPU,
from the global RNG the caller seeded - and moved to the device. Parameters stay in the dtype
they were built in (float32 for presets and hf:); the runner casts to the run's dtype.
"""
from __future__ import annotations

from tpdiag.models.spec import ModelSpec


def build_target(spec: ModelSpec, variant: str, device, seed: int):
    from tpdiag.models.target import Target

    if spec.kind == "builtin":
        from tpdiag.models import tiny_llama
        from tpdiag.models.plans import llama_plan

        model = tiny_llama.build_on(device, seed, spec.value)
        return Target(model=model, plan=llama_plan(variant), vocab_size=model.cfg.vocab_size,
                      divisors=model.cfg.divisors())
    if spec.kind == "hf":
        from tpdiag.models.hf import load_hf_target

        return load_hf_target(spec.value, variant, device=device, seed=seed)
    from tpdiag.models.spec import py_target

    t = py_target(spec.value, variant)
    if any(p.is_meta for p in list(t.model.parameters()) + list(t.model.buffers())):
        from tpdiag.models.meta_init import materialize, reset_parameters_rule

        materialize(t.model, device, seed, t.init or reset_parameters_rule)
    else:
        t.model = t.model.to(device)
    return t
