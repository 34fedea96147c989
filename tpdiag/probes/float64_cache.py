"""A KV cache among a module call's arguments (transformers' `Cache`: what an HF model builds in a
training forward when its config says `use_cache: true` - a user's own `py:` factory keeps it),
as the float64 re-executions must see it.

Why: the cache is a Python object, not a tensor: a snapshot that only copies tensors keeps the
real object, which the real call then updates (DynamicCache.update concatenates the layer's keys
and values onto its slot). Every re-execution from that snapshot attended over the keys the real
call (and each earlier re-execution) had appended as well as its own: at Phi-3 layer 1, re-executed
from TP=2's own inputs, the float64 output was 0.84 relative from TP=2's output and 0.12 from
TP=1's (the right value is 2.8e-3 from TP=2's) - a correct attention read `sharding-bug`. And
each re-execution appended to the user's cache.

So the snapshot keeps the cache as it was before the call, and each re-execution runs on its own
copy of that. The copy shares the cached tensors (detached): a DynamicCache's update makes new
tensors, so the real cache and the snapshot are untouched; a cache written in place (StaticCache's
index_copy_ into its bf16 storage) is a write the float64 mode refuses, as before.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


def is_cache(x) -> bool:
    t = type(x)
    return t.__module__.startswith("transformers") and any(c.__name__ == "Cache" for c in t.__mro__)


def _copy(x, memo: dict):
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, torch.Tensor):
        got = x.detach()
    elif isinstance(x, list):
        got = memo[id(x)] = []
        got.extend(_copy(v, memo) for v in x)
    elif isinstance(x, tuple):
        got = type(x)(*(_copy(v, memo) for v in x)) if hasattr(x, "_fields") else tuple(_copy(v, memo) for v in x)
    elif isinstance(x, dict):
        got = memo[id(x)] = type(x)()
        got.update((k, _copy(v, memo)) for k, v in x.items())
    elif type(x).__module__.startswith("transformers") and hasattr(x, "__dict__") \
            and not isinstance(x, torch.nn.Module):
        # the cache and its layers (their configs too: read only, copied shallowly all the same)
        got = memo[id(x)] = object.__new__(type(x))
        got.__dict__.update((k, _copy(v, memo)) for k, v in vars(x).items())
    else:
        return x  # numbers, strings, dtypes, devices: never updated in place by a cache
    memo[id(x)] = got
    return got


def kept(tree):
    """tree with each cache in it replaced by a copy of its present state (tensors shared)."""
    return tree_map(lambda x: _copy(x, {}) if is_cache(x) else x, tree)


def has_cache(tree) -> bool:
    from torch.utils._pytree import tree_flatten

    return any(is_cache(x) for x in tree_flatten(tree)[0])


def read_slots_empty(mod: torch.nn.Module, tree) -> bool:
    """Whether every cache in tree holds nothing at the layers mod's subtree reads (their
    `layer_idx`; every layer where none names one): the call then reads no cached value, only
    what it appends itself. A cache that holds some is state of the reference's that another
    world's records do not carry (its earlier keys and values)."""
    from torch.utils._pytree import tree_flatten

    caches = [x for x in tree_flatten(tree)[0] if is_cache(x)]
    if not caches:
        return True
    idx = {m.layer_idx for m in mod.modules() if isinstance(getattr(m, "layer_idx", None), int)}
    try:
        for c in caches:
            n = len(getattr(c, "layers", ()) or ())
            for i in (idx or range(max(n, 1))):
                if c.get_seq_length(i) > 0:
                    return False
    except Exception:  # noqa: BLE001 - a cache this check cannot read: counted as holding some
        return False
    return True
