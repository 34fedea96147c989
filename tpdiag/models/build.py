"""The full, unsharded Target of a world, built where it will run.

Built-in presets, `hf:` models and `py:` targets that opt in are built on the meta device and
materialised on the run's device (tpdiag.models.meta_init: each module initialised from an
RNG seeded by (seed, its fqn)), so no rank builds the whole model on its CPU first and every
degree holds the same weights. Other `py:` targets are built as before - FUNC() on the CPU,
from the global RNG the caller seeded - and moved to the device. Parameters stay in the dtype
they were built in (float32 for presets and hf:); the runner casts each to the dtype the
user's own loading gives it (tpdiag.models.dtypes).

At TP > 1, built-in presets and `hf:` models go through build_sharded instead: the plan is
applied on the meta model and each module is then materialised, cast and cut to this rank's
shard on its own (tpdiag.models.shard_init), so no rank holds the whole model.
"""
from __future__ import annotations

from contextlib import contextmanager

from tpdiag.models.spec import ModelSpec


def build_target(spec: ModelSpec, variant: str, device, seed: int, need_plan: bool = True):
    from tpdiag.models.target import Target

    if spec.kind == "builtin":
        from tpdiag.models import tiny_llama
        from tpdiag.models.plans import llama_plan

        model = tiny_llama.build_on(device, seed, spec.value, **spec.preset_overrides())
        return Target(model=model, plan=llama_plan(variant), vocab_size=model.cfg.vocab_size,
                      divisors=model.cfg.divisors())
    if spec.kind == "hf":
        from tpdiag.models.hf import load_hf_target

        return load_hf_target(spec.value, variant, device=device, seed=seed, layers=spec.layers,
                              need_plan=need_plan)
    from tpdiag.models.spec import py_target

    t = py_target(spec.value, variant)
    if any(p.is_meta for p in list(t.model.parameters()) + list(t.model.buffers())):
        from tpdiag.models.meta_init import materialize, reset_parameters_rule

        materialize(t.model, device, seed, t.init or reset_parameters_rule)
    else:
        t.model = t.model.to(device)
    return t


def build_sharded(spec: ModelSpec, variant: str, device, seed: int, dtype, mesh, check_plan):
    """(Target, model) at TP > 1 with the plan applied on the meta device and every module
    materialised shard by shard, bitwise the whole path's weights; `target.build` says so. None
    for py: targets (they build the whole model). Raises ShardedInitUnsupported (its message the reason) where this model
    cannot take this route - the caller then builds the whole model."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from tpdiag.errors import BadInput
    from tpdiag.models.shard_init import ShardedInitUnsupported, materialize_sharded

    fill_ctx, guard, rule = None, None, None
    if spec.kind == "builtin":
        from tpdiag.models import tiny_llama
        from tpdiag.models.plans import llama_plan
        from tpdiag.models.target import Target

        plan = llama_plan(variant)
        with torch.device("meta"):
            model = tiny_llama.build(spec.value, **spec.preset_overrides())
        target = Target(model=model, plan=plan, vocab_size=model.cfg.vocab_size,
                        divisors=model.cfg.divisors())
        rule = model.init_module
    elif spec.kind == "hf":
        from tpdiag.models import hf

        built = hf.meta_hf_target(spec.value, variant, layers=spec.layers)
        if built is None:
            raise ShardedInitUnsupported("the checkpoint's tensor names are not the model's own "
                                         "(loaded with from_pretrained)")
        target, mapping = built
        model, rule, guard = target.model, hf.init_rule(target.model), hf.init_guard
        if mapping is not None:
            from tpdiag.models import weights

            fill_ctx = (mapping,)
    else:
        return None
    # the dtype cast is done per tensor by materialize_sharded, after the init (as the whole path),
    # by the source's rule (tpdiag.models.dtypes: float32 buffers stay float32)
    from tpdiag.models.dtypes import mark_config, rule_for

    dtype_rule = rule_for(spec.kind, model, dtype)
    mark_config(spec.kind, model, dtype)
    if target.plan:
        check_plan(model, target.plan)
        from tpdiag.models.grad_hooks import dropped_hooks, grad_hooks
        from tpdiag.models.ties import broken_ties, tie_groups

        ties, hooks = tie_groups(model), grad_hooks(model)
        try:
            with plan_warnings():
                parallelize_module(model, mesh, target.plan)
        except (BadInput, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - a style that cannot run on meta: whole path
            raise ShardedInitUnsupported(f"the plan cannot be applied on the meta device: "
                                         f"{type(e).__name__}: {_first_line(e)}") from None
    from contextlib import ExitStack, nullcontext

    with ExitStack() as stack:
        fill = None
        if fill_ctx is not None:
            fill = stack.enter_context(weights.filler(model, fill_ctx[0], device))
        try:
            stats = materialize_sharded(model, device, seed, rule, dtype_rule, fill=fill,
                                        context=guard or nullcontext)
        except (ShardedInitUnsupported, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - a rule that needs the whole model (or finds
            # a tensor unfilled that a later rule fills): the whole path decides
            raise ShardedInitUnsupported(f"init rule failed shard by shard: {type(e).__name__}: "
                                         f"{_first_line(e)}") from None
    target.build = {"init": "sharded", "init_full_peak_bytes": stats["full_peak_bytes"],
                    "init_whole_bytes": stats["whole_bytes"]}
    broken = broken_ties(model, ties) if target.plan else []
    if broken:
        target.build["ties_broken"] = broken
    dropped = dropped_hooks(hooks, model) if target.plan else {}
    if dropped:
        target.build["hooks_dropped"] = dropped
    return target, model


@contextmanager
def plan_warnings():
    """parallelize_module with torch's warning per module a plan key does not resolve in left out:
    transformers' plans are written for every layer (`layers.*.mlp.experts`), and a model whose first
    layers are dense (deepseek_v2's first_k_dense_replace) printed one, with the module's repr, per
    key and dense layer on every rank (56 on a 2-layer model at TP=2). A key matching no module at
    all is refused before this (runner/build.py _check_plan)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Parallelize plan key .* could not be resolved",
                                category=UserWarning)
        yield


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""
