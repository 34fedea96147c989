"""A world's model on one rank: built, cast and sharded as the configuration asks."""
from __future__ import annotations

import torch

from tpdiag.config import WorldConfig


def build_model(cfg: WorldConfig, device: torch.device, world: int):
    """(target, model) on this rank, sharded when world > 1. Built-in presets and hf: models are
    sharded on the meta device and materialised module by module (no rank holds the whole
    model: tpdiag.models.shard_init); py: targets, and a model that cannot take that route
    (the reason in target.build), are built whole, cast, then sharded."""
    from tpdiag.models.build import build_sharded, build_target
    from tpdiag.models.spec import parse_spec

    torch.manual_seed(cfg.seed)  # py: targets built on the CPU draw from the global RNG
    spec, dtype, mesh, reason = parse_spec(cfg.model, cfg.layers), getattr(torch, cfg.dtype), None, None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from tpdiag.models.shard_init import ShardedInitUnsupported

        mesh = init_device_mesh(device.type, (world,))
        try:
            built = build_sharded(spec, cfg.variant, device, cfg.seed, dtype, mesh, _check_plan)
        except ShardedInitUnsupported as e:
            built, reason = None, str(e)
        if built is not None:
            return built
        torch.manual_seed(cfg.seed)
    # a TP=1 world applies no plan: a model with none (stablelm) runs there, as under rollout
    # --tp 1; at TP > 1 the parent refused it before launch (models/precheck.py)
    target = build_target(spec, cfg.variant, device, cfg.seed, need_plan=world > 1)
    live = {id(t): t for t in list(target.model.parameters()) + list(target.model.buffers())}
    whole = sum(t.numel() * t.element_size() for t in live.values())
    from tpdiag.models.dtypes import to_run_dtype

    # the user's model as the user loads it: not nn.Module.to(dtype) (tpdiag.models.dtypes)
    model = to_run_dtype(spec.kind, target.model.to(device=device), dtype)
    if world > 1 and target.plan:
        from torch.distributed.tensor.parallel import parallelize_module

        from tpdiag.models.grad_hooks import dropped_hooks, grad_hooks
        from tpdiag.models.ties import broken_ties, tie_groups

        _check_plan(model, target.plan)
        ties, hooks = tie_groups(model), grad_hooks(model)
        from tpdiag.models.build import plan_warnings

        with plan_warnings():
            parallelize_module(model, mesh, target.plan)
        broken, dropped = broken_ties(model, ties), dropped_hooks(hooks, model)
    else:
        broken, dropped = [], {}
    per_rank = 0
    if world > 1:
        from tpdiag.runner.per_rank import mark_params

        per_rank = mark_params(model, world)  # an expert-parallel model's own experts (grad norm, gather)
    target.build = {"init": "whole", "init_full_peak_bytes": whole, "init_whole_bytes": whole,
                    "init_reason": reason or ("TP=1" if world == 1 else
                                              f"{spec.kind}: the whole model is built, then sharded")}
    if broken:
        target.build["ties_broken"] = broken
    if dropped:
        target.build["hooks_dropped"] = dropped
    if per_rank:
        target.build["per_rank_params"] = per_rank
    return target, model


def _check_plan(model, plan: dict) -> None:
    import fnmatch

    from tpdiag.errors import BadInput

    names = [n for n, _ in model.named_modules()]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise BadInput(f"plan entry {pattern!r} matches no module of the model")
    for n in names:
        hits = [p for p in plan if fnmatch.fnmatchcase(n, p)]
        if len(hits) > 1:
            raise BadInput(f"plan entries {hits[0]!r} and {hits[1]!r} both match module {n!r}")


def capture_mode(capture: str, model) -> str:
    """'full' or 'hash'; 'auto' hashes models above AUTO_HASH_PARAMS (counted whole: a
    DTensor parameter's numel is its global size, so every degree decides the same)."""
    if capture != "auto":
        return capture
    from tpdiag.config import AUTO_HASH_PARAMS

    n = sum(p.numel() for p in model.parameters())
    return "hash" if n > AUTO_HASH_PARAMS else "full"
