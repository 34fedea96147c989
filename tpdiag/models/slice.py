"""`--layers N`: the model cut to its first N decoder layers, with its real embedding, final
norm and LM head - the way to diagnose a model whose reference world does not fit (a 70B
model at TP=1 on one GPU) on the layers that show how every layer kind behaves.

The slice is the real model's first N layers with the same weights, not a smaller model:
- built-in presets: the preset with n_layers = N;
- hf: the config loaded by transformers, then num_hidden_layers = N and every per-layer list
  cut to its first N entries (layer_types - sliding-window / full / linear attention patterns -,
  no_rope_layers and any other list of one entry per layer), and lists of layer indices
  (mlp_only_layers: which layers are dense in an MoE) keep the indices below N. Integers that
  say where a pattern starts (first_k_dense_replace, max_window_layers) need no change: layer i
  of the slice is layer i of the model.
Weights: tpdiag's seeded init draws each module's tensors from (seed, its fqn)
(models/meta_init.py), so layers.0 of the slice holds bitwise the full model's layers.0 (the
embedding and head too); a checkpoint's tensors of the dropped layers are skipped. One caveat:
an init rule may read the depth (GPT-2 scales c_proj by 1/sqrt(2 * n_layer), tpdiag's presets
wo and w2 alike): those rules run with the whole model's depth (whole_depth below; the presets'
init_depth), so the slice's weights stay the whole model's.
"""
from __future__ import annotations

import re

from tpdiag.errors import BadInput

# lists of layer indices (not one entry per layer): keep the indices below N
INDEX_LISTS = ("mlp_only_layers", "moe_layers", "attn_layer_indices", "full_attn_idxs")
_NOT_PER_LAYER = ("architectures",)
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def slice_text_config(tc, n: int) -> dict:
    """Cut a transformers text config to its first n layers, in place; returns what changed
    ({key: description}) for the manifest."""
    total = int(tc.num_hidden_layers)
    changed = {"num_hidden_layers": f"{total} -> {n}"}
    tc.num_hidden_layers = n
    tc.tpdiag_init_depth = total  # what the init rules read as the depth (whole_depth, below)
    for key, value in list(vars(tc).items()):
        if key.startswith("_") or key in _NOT_PER_LAYER or not isinstance(value, (list, tuple)):
            continue
        if key in INDEX_LISTS and all(isinstance(i, int) for i in value):
            kept = type(value)(i for i in value if i < n)
            if len(kept) != len(value):
                setattr(tc, key, kept)
                changed[key] = f"indices below {n}: {list(kept)}"
        elif len(value) == total:
            setattr(tc, key, type(value)(value[:n]))
            changed[key] = f"first {n} of {total}"
    return changed


class whole_depth:
    """Within: the config says the whole model's num_hidden_layers (an init rule reads it)."""

    def __init__(self, tc):
        self.tc, self.depth = tc, getattr(tc, "tpdiag_init_depth", None)

    def __enter__(self):
        if self.depth:
            self.sliced, self.tc.num_hidden_layers = self.tc.num_hidden_layers, self.depth

    def __exit__(self, *exc):
        if self.depth:
            self.tc.num_hidden_layers = self.sliced
        return False


def dropped_key(key: str, n: int) -> bool:
    """A checkpoint tensor of a layer the slice does not have (layers.I. with I >= n)."""
    m = _LAYER_KEY.search(key)
    return m is not None and int(m.group(1)) >= n


def check_layers(spec, n: int, total: int | None) -> None:
    """--layers N: refused in one line where it cannot be the model's first N layers."""
    if n == 0:
        return
    if spec.kind == "py":
        raise BadInput(f"--layers {n}: a py: target builds its own model; build fewer layers in "
                       "FUNC instead (--layers applies to built-in models and hf:DIR)")
    if n < 1:
        raise BadInput(f"--layers {n}: must be >= 1 (the first N decoder layers)")
    if total is not None and n > total:
        raise BadInput(f"--layers {n}: the model has {total} decoder layers; use --layers {total} or less")


def describe(n: int, total: int | None) -> str:
    return (f"the first {n} of {total} decoder layers" if total else f"the first {n} decoder layers") + \
        " with the real embedding and head"

