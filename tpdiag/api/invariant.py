"""The public switch for a user's own DTensor TP model and training loop:

    with tpdiag.invariant(model, plan, fixes="all", tree_groups=8):
        ...  # the user's forward, F.cross_entropy, backward, tpdiag.clip_grad_norm_, opt.step()

It installs the same fixes `tpdiag compare --fix ...` installs in its own worlds (fixes/registry.py),
with the run's tree groups G (kernels/tree.py), inside `tpdiag.deterministic()`, and takes
everything back in `finally`. Bad input is one typed error (BadInput) that every rank raises
alike, with nothing left installed: the arguments are checked first, each planned layer's
reduced dimension as its fix installs (the stack unwinds).

What the runner does itself and a user loop does not: its loss and grad norm. Here the
vocab-softmax fix catches the user's F.cross_entropy (fixes/vocab_loss.py) and the grad-norm
fix is `clip_grad_norm_` below, which the loop calls instead of its own clip.
"""
from __future__ import annotations

import fnmatch
from contextlib import ExitStack, contextmanager

from tpdiag.errors import BadInput, BadType

GEMMS = ("per-group", "fused")


def fix_names() -> tuple[str, ...]:
    """Every fix `fixes=` accepts (besides "all" and "none"), in the order "all" installs them."""
    from tpdiag.fixes.registry import catalogue

    return tuple(n for n, f in catalogue().items() if f.install is not None)


def _fixes(fixes) -> tuple[str, ...]:
    names = fix_names()
    given = fixes
    if isinstance(fixes, str):
        fixes = [n.strip() for n in fixes.split(",") if n.strip()]
    try:
        fixes = list(fixes)
    except TypeError:
        raise BadType(f"fixes={fixes!r}: must be 'all', 'none', a fix name or a list of them, "
                      f"not {type(fixes).__name__}") from None
    if not fixes:
        # an empty list installs nothing: almost surely a mistake, never a silent no-op
        raise BadInput(f"fixes={given!r}: no fix named; give 'all', a fix name or a list of them "
                       "('none' for determinism only)")
    if any(not isinstance(n, str) for n in fixes):
        raise BadType(f"fixes={given!r}: every fix must be a name (str)")
    if fixes == ["none"]:
        return ()
    if fixes == ["all"]:
        return names
    for n in fixes:
        if n not in names:
            raise BadInput(f"fixes: unknown fix {n!r}; expected 'all', 'none' or any of {', '.join(names)}")
    if len(set(fixes)) != len(fixes):
        raise BadInput(f"fixes={fixes!r}: a fix is named twice")
    return tuple(n for n in names if n in fixes)  # the order "all" uses, whatever order was given


def tp_degree(model) -> int:
    """The TP degree of `model`: the size of the one 1-D mesh its DTensor parameters live on
    (1 when none is a DTensor). The invariant reductions run over the default process group,
    so that mesh must be the whole world."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    # equal meshes count once: parallelize_module can leave equal DeviceMesh objects on one model
    # (a GPT-2 with a ColwiseParallel(use_local_output=False) head, built twice in one process)
    meshes = {p.device_mesh: p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise BadInput(f"model: its DTensor parameters live on {len(meshes)} device meshes; "
                       "tpdiag.invariant supports one 1-D TP mesh")
    mesh = next(iter(meshes.values()), None)
    if mesh is not None and mesh.ndim != 1:
        raise BadInput(f"model: a {mesh.ndim}-D device mesh {tuple(mesh.shape)}; tpdiag.invariant "
                       "supports a 1-D TP mesh over the whole world (no DP / PP dimension)")
    tp = mesh.size() if mesh is not None else 1
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != tp:
        raise BadInput(f"model: TP={tp} in a world of {world} ranks; tpdiag.invariant's reductions "
                       "run over the whole world, so the TP mesh must span it")
    return tp


def check_groups(tree_groups, tp: int, fixes) -> int:
    """The G to install: 0 when no fix cuts its reductions into groups."""
    from tpdiag.fixes import groups

    uses = groups.uses_groups(fixes)
    if tree_groups is None:
        chosen = groups.explicit(None)  # TPDIAG_TREE_GROUPS, as the CLI reads it
        if chosen is None:
            if not uses:
                return 0
            raise BadInput(f"tree_groups: required with {', '.join(groups.grouped(fixes))}: "
                           "the largest TP degree you will compare (a power of two, e.g. 8), "
                           "the same at every degree")
        tree_groups = chosen[0]
    if isinstance(tree_groups, bool) or not isinstance(tree_groups, int):
        raise BadType(f"tree_groups={tree_groups!r}: must be an int (a power of two >= 1, e.g. 8), "
                      f"not {type(tree_groups).__name__}")
    if tree_groups < 1 or tree_groups & (tree_groups - 1):
        raise BadInput(f"tree_groups={tree_groups!r}: must be a power of two >= 1, e.g. 8")
    if uses and (tp & (tp - 1)):
        raise BadInput(f"TP={tp}: the invariant reductions need a power-of-two TP degree")
    if uses and tree_groups % tp:
        raise BadInput(f"tree_groups={tree_groups}: TP={tp} does not divide it; pick G = the "
                       "largest TP degree you will compare (every degree must divide G)")
    return tree_groups if uses else 0


# style names a plan may give instead of ParallelStyle objects (a stack without a plan dict,
# e.g. torchtitan's own sharding, labelled from its weights' placements); the fixes read only
# which kind of layer it is
NAMES = ("colwise", "rowwise", "sequence")


def _style(name: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}[name]()


def check_plan(model, plan) -> dict:
    """The plan to install by: as given, style names made ParallelStyle objects."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise BadType(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, dict):
        raise BadType(f"plan: expected the {{module glob: ParallelStyle}} dict given to "
                      f"parallelize_module, got {type(plan).__name__}")
    names = [n for n, _ in model.named_modules()]
    out = {}
    for key, style in plan.items():
        if isinstance(style, str):
            if style not in NAMES:
                raise BadInput(f"plan[{key!r}] = {style!r}: expected a ParallelStyle object or one of "
                               f"{', '.join(NAMES)}")
            style = _style(style)
        if not isinstance(key, str):
            raise BadType(f"plan key {key!r}: must be a module name or glob (str), not {type(key).__name__}")
        if not any(fnmatch.fnmatchcase(n, key) for n in names):
            raise BadInput(f"plan[{key!r}]: matches no module of {type(model).__name__}")
        out[key] = style
    _check_covers(model, out)
    return out


def _check_covers(model, plan: dict) -> None:
    """Sharded parameters and a plan that names none of their modules: the fixes would wrap
    nothing sharded and the run quietly lose bitwise equality (plan={} on a parallelized model)."""
    from torch.distributed.tensor import DTensor

    sharded = [n for n, m in model.named_modules()
               if any(isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)
                      for p in m.parameters(recurse=False))]
    if not sharded or any(fnmatch.fnmatchcase(n, k) for n in sharded for k in plan):
        return
    raise BadInput(f"plan: names none of the {len(sharded)} modules with sharded DTensor parameters "
                   f"(e.g. {', '.join(sharded[:3])}); give tpdiag.invariant the plan you gave "
                   "parallelize_module")


_ACTIVE: list = []  # the model of the open tpdiag.invariant block (at most one)


@contextmanager
def invariant(model, plan: dict, *, fixes="all", tree_groups: int | None = None,
              group_gemm: str = "per-group", deterministic: bool = True):
    """Turn tpdiag's invariant kernels on for `model` (sharded with `plan` at TP > 1; the same
    plan, unapplied, at TP=1) until the block ends.

    plan may also give "colwise" / "rowwise" / "sequence" for a module sharded by other means.
    fixes: "all", "none", a fix name, "a,b" or a list (fix_names()). tree_groups: G, the number
    of fixed groups a reduced dimension is cut into - a power of two that every TP degree you
    compare divides, the same in all of them (default: TPDIAG_TREE_GROUPS; required when a
    grouped fix is on). group_gemm: "per-group" (one GEMM per group: at TP = G one per rank)
    or "fused" (a rank's groups in one call); two runs are bitwise equal only with the same G and group_gemm. deterministic: also
    enter tpdiag.deterministic() (strict deterministic algorithms, no TF32, ...).
    """
    if _ACTIVE:
        raise BadInput("tpdiag.invariant: already inside a tpdiag.invariant block; they do not "
                       "nest (one block around the whole loop)")
    plan = check_plan(model, plan)
    names = _fixes(fixes)
    if not isinstance(group_gemm, str):
        raise BadType(f"group_gemm={group_gemm!r}: must be a str, one of {', '.join(GEMMS)}")
    if group_gemm not in GEMMS:
        raise BadInput(f"group_gemm={group_gemm!r}: expected one of {', '.join(GEMMS)}")
    if not isinstance(deterministic, bool):
        raise BadType(f"deterministic={deterministic!r}: must be True or False, not "
                      f"{type(deterministic).__name__}")
    tp = tp_degree(model)
    g = check_groups(tree_groups, tp, names)
    from tpdiag.api.determinism import deterministic as det
    from tpdiag.fixes.registry import apply_fixes, catalogue
    from tpdiag.kernels.tree import install_tree_groups

    cat = catalogue()

    with ExitStack() as stack:
        _ACTIVE.append(model)
        stack.callback(_ACTIVE.pop)
        if deterministic:
            stack.enter_context(det())
        # G first: the fixes check every reduced dimension against it as they install
        stack.enter_context(install_tree_groups(g, group_gemm == "per-group"))
        stack.enter_context(apply_fixes(names, model=model, plan=plan, world=tp))
        # what a fix takes over from the runner, the user's own loop computes: its own install
        for f in (cat[n] for n in names):
            if f.user_install is not None:
                stack.enter_context(f.user_install())
        yield


def clip_grad_norm_(parameters, max_norm: float | None):
    """The global L2 norm of the parameters' grads, and the grads scaled to at most max_norm
    (None: the norm only). Under tpdiag.invariant with invariant-grad-norm on: each grad
    gathered whole and a float64 norm in parameter order (the same bits at every TP), then
    torch.nn.utils.clip_grad_norm_'s own coefficient, min(max_norm / (norm + 1e-6), 1), from
    that norm in torch's norm dtype, kept on the device (no host sync): where the norms agree
    the scaled grads are torch's bit for bit. Returns the float64 norm. Otherwise an ordinary
    float32 global norm over the grads' shards."""
    import torch

    from tpdiag.fixes import registry

    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))):
        raise BadType(f"max_norm={max_norm!r}: must be a number or None, not {type(max_norm).__name__}")
    if max_norm is not None and not max_norm > 0:
        raise BadInput(f"max_norm={max_norm!r}: expected a positive number or None")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if registry.takes_over("grad-norm"):
        from tpdiag.kernels.grad_norm import grad_norm_and_clip

        with torch.no_grad():
            return grad_norm_and_clip(params, max_norm)
    return _stock_clip(params, max_norm)


def _stock_clip(params, max_norm):
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(
            [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
        if max_norm is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        return total


@contextmanager
def accumulate_grads(model):
    """Gradient accumulation whose weight grads are bitwise the same for any micro-batch split:

        with tpdiag.invariant(model, plan, fixes="all", tree_groups=...):
            opt.zero_grad(set_to_none=True)
            with tpdiag.accumulate_grads(model):
                for piece in pieces:                  # forward AND backward inside
                    loss_of(model(piece)).backward()
            tpdiag.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    Inside the block the invariant fixes' weight-grad reductions over tokens (linear and bias
    weights under invariant-gemm, embeddings under invariant-gemm, replicated RMSNorm weights
    under invariant-norm-grad) go into one fp32 carry per weight, walked over the tokens in
    fixed blocks; when the block ends each carry is rounded once to its parameter's dtype and
    accumulated into .grad (post-accumulate-grad hooks run). Every piece but the last must hold
    a multiple of the block's tokens (8 on the CPU, 64 on CUDA): else BadInput. Other grads
    (MoE experts, unwrapped modules) accumulate as usual. On an exception nothing is applied."""
    from torch import nn

    from tpdiag.fixes import registry
    from tpdiag.kernels.grad_carry import window

    if not isinstance(model, nn.Module):
        raise BadType(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not registry.carrying():
        raise BadInput("accumulate_grads: no fix that carries weight grads is on; use it inside "
                       f"tpdiag.invariant(..., fixes=...) with {' or '.join(registry.carry_fixes())} (or 'all')")
    with window(model, warn=True):
        yield
