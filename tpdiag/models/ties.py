"""Weight ties across a plan: parameters the unsharded model shares (a tied embedding and LM
head) must stay ONE parameter after `parallelize_module`. Each style distributes the parameters
of its own module, so a plan that shards both users of a tied weight replaces it twice, with two
DTensors: at TP > 1 each gets only its own uses' grad where TP=1 sums every use into one, and
the two are trained apart from the first optimizer step - a wrong result no layout bound or
own-input re-execution sees (a tied grad is a sum over modules, so the reference's own module
re-execution is as far from its record as TP=N's)."""
from __future__ import annotations


def tie_groups(model) -> list[tuple[str, ...]]:
    """The names of each parameter the model holds under more than one name."""
    by: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by.setdefault(id(p), []).append(name)
    return [tuple(v) for v in by.values() if len(v) > 1]


def broken_ties(model, groups: list[tuple[str, ...]]) -> list[list[str]]:
    """The groups that are no longer one parameter."""
    out = []
    for g in groups:
        if len({id(model.get_parameter(n)) for n in g}) > 1:
            out.append(list(g))
    return out
