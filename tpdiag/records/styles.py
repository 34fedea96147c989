"""A TP plan's ParallelStyle as the short label a record carries ('colwise', 'rowwise', ...).

Read from the style's class name, so plans built by tpdiag, by Hugging Face or by a user all
label alike, and no torch import is needed here.
"""
from __future__ import annotations

import fnmatch


def style_of(fqn: str, plan: dict) -> str | None:
    """The plan's style for a module, as a short label: 'colwise', 'rowwise', 'embedding', ...

    An input-gathering ColwiseParallel (the 'stable' out-projection) is labelled 'colwise-gathered'.
    """
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(fqn, pattern):
            return style_label(style)
    return None


def style_label(style) -> str:
    name = type(style).__name__
    if name == "ColwiseParallel":
        inp = getattr(style, "input_layouts", None)
        inp = inp[0] if isinstance(inp, tuple) and inp else inp
        if inp is not None and type(inp).__name__ == "Shard":
            return "colwise-gathered"
        return "colwise"
    if name == "RowwiseParallel":
        return "rowwise"
    if name == "SequenceParallel":
        return "sequence"
    if name == "PrepareModuleInput" or name == "PrepareModuleOutput":
        return "prepare"
    return name.lower()


def output_partial(fqn: str, plan: dict) -> bool:
    """Whether the plan's style for `fqn` makes the module's output each rank's share of a sum
    that is all-reduced later (transformers' `moe_identity_expert`: input / TP, summed over ranks
    with the routed experts), i.e. an unreduced partial rather than a replica."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(fqn, pattern):
            return bool(getattr(style, "output_partial", False))
    return False


def output_grad_partial(fqn: str, plan: dict) -> bool:
    """Whether the plan's style for `fqn` all-reduces its output's gradient inside the module.

    Then the gradient arriving at the module's output is each rank's unreduced partial (e.g.
    transformers' `mla_kv_a_proj`: the rope columns feed every rank's local heads and are summed
    over ranks only in the module's own backward), not a replica.
    """
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(fqn, pattern):
            return bool(getattr(style, "output_grad_partial", False))
    return False
