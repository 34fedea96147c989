"""Grad hooks a plan drops: a hook the user put on a parameter's grad (`p.register_hook`,
`p.register_post_accumulate_grad_hook`) before `parallelize_module` lives on that Parameter
object, and each style replaces the parameters of its module with new DTensor Parameters - the
hook does not come with them. It runs at TP=1 (no plan applied) and silently not at TP > 1, so the
weight's grad (a scale, a clip, a user's own all-reduce) differs by the hook's whole effect: a
wrong result no layout bound or float64 re-execution sees (the re-execution runs the module, not
the user's hook; from this side's own inputs TP=N's grad is exact). The diff names it at the
weight's grad (diff/analyse.py)."""
from __future__ import annotations


def _hooks(p) -> list:
    return [*(getattr(p, "_backward_hooks", None) or {}).values(),
            *(getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()]


def grad_hooks(model) -> dict[str, list]:
    """{parameter name: the hook callables on its grad} for every parameter that has any."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        hooks = _hooks(p)
        if hooks:
            out[name] = hooks
    return out


def hook_names(model) -> dict[str, list[str]]:
    """{parameter name: its grad hooks' names} (a capture's world.json param_hooks: the hooks on the
    parameters it was handed, which a `tpdiag diff` compares with the reference capture's)."""
    return {n: [hook_name(h) for h in hooks] for n, hooks in grad_hooks(model).items()}


def dtensor_names(model) -> list[str]:
    """The parameters that are DTensors (a plan's: a hook put on the parameter before it is not on these)."""
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_local_tensor"))


def hook_name(fn) -> str:
    """How the user wrote the hook: its function's qualified name (`halve`, `MLPLM.__init__.<locals>.
    <lambda>`), a partial's function, or the callable's class."""
    import functools

    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(fn, "__code__", None)
    if "<lambda>" in name and code is not None:
        import os

        name += f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return name


def dropped_hooks(before: dict[str, list], model) -> dict[str, list[str]]:
    """{parameter name: names of the hooks it had in `before` (grad_hooks before the plan) that its
    parameter now lacks}: each hook is compared by identity, so a hook registered again on the new
    parameter counts as kept."""
    out = {}
    for name, hooks in before.items():
        try:
            now = {id(h) for h in _hooks(model.get_parameter(name))}
        except AttributeError:  # a parameter the plan removed: its hooks went with it
            now = set()
        lost = [hook_name(h) for h in hooks if id(h) not in now]
        if lost:
            out[name] = lost
    return out


def watch(model, effect: dict) -> None:
    """Wrap each grad hook on the model's parameters so that effect[parameter name] says whether any
    of them changed the grad (True) or only looked at it (False: a logger, a clip that did not act)
    - a dropped observer changes nothing, a dropped scale or clip changes the training. The wrapper
    returns what the hook returns, so the numbers are the hook's own. For the reference's world
    (nothing sharded), where the hooks run: a wrapped hook is a new object, so run after the plan's
    dropped_hooks check."""
    for name, p in model.named_parameters(remove_duplicate=False):
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(p, attr, None)
            if not hooks:
                continue
            effect.setdefault(name, False)
            for key, fn in list(hooks.items()):
                hooks[key] = _on_grad(fn, name, effect) if attr == "_backward_hooks" else _on_param(fn, name, effect)


def _equal(a, b) -> bool:
    """torch.equal of two grads, a sparse one (nn.Embedding(sparse=True)'s) by its dense value: aten::equal
    has no sparse kernel."""
    import torch

    from tpdiag.base.sparse import strided

    return torch.equal(strided(a), strided(b))


def _on_grad(fn, name: str, effect: dict):
    import functools

    import torch

    @functools.wraps(fn)
    def hook(g):
        out = fn(g)
        if out is not None and not (out is g or _equal(out, g)):
            effect[name] = True
        return out
    return hook


def _on_param(fn, name: str, effect: dict):
    import functools

    import torch

    @functools.wraps(fn)
    def hook(p):
        # a post-accumulate hook acts through the grad or through the parameter itself (an optimizer
        # step in the backward that leaves the grad in place): either change is an effect
        before = None if p.grad is None else p.grad.detach().clone()
        value = p.detach().clone()
        out = fn(p)
        if (before is None) != (p.grad is None) or before is not None and not _equal(before, p.grad) \
                or not torch.equal(value, p.detach()):
            effect[name] = True
        return out
    return hook
