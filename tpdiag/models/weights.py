"""Copy `*.safetensors` weights straight onto a materialised model's device, tensor by tensor.

Each tensor is read lazily (tpdiag.base.files.open_safetensors), straight onto the device, into the
parameter that has its name, so no rank ever holds a full CPU copy of the model. Only checkpoints whose names and
shapes are the model's own can be read this way (what `save_pretrained` writes for dense models);
for anything else - renamed or fused keys (e.g. per-expert MoE weights transformers fuses on
load) - `plan()` returns None and the caller loads with `from_pretrained` instead.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn


def _names(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def plan(model: nn.Module, files: list[str], prefix: str = "", skip=None) -> dict[str, tuple[str, str]] | None:
    """{model tensor name: (file, checkpoint key)} covering every checkpoint key, or None when a
    key is not one of the model's tensors with the same shape (also tried under `prefix.`).
    skip(key): a key not to read (a layer `--layers` leaves out: tpdiag/models/slice.py)."""
    from tpdiag.base.files import open_safetensors

    names = _names(model)
    out: dict[str, tuple[str, str]] = {}
    for path in files:
        with open_safetensors(path) as f:
            for key in f.keys():
                if skip is not None and skip(key):
                    continue
                name = key if key in names else f"{prefix}.{key}" if prefix else key
                t = names.get(name)
                if t is None or list(t.shape) != list(f.get_slice(key).get_shape()):
                    return None
                out[name] = (path, key)
    return out


@torch.no_grad()
def load(model: nn.Module, mapping: dict[str, tuple[str, str]], device) -> None:
    """Copy every mapped checkpoint tensor into its model tensor (cast to that tensor's dtype,
    as from_pretrained's load-time cast does)."""
    from tpdiag.base.files import open_safetensors

    names = _names(model)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, (path, key) in mapping.items():
        by_file.setdefault(path, []).append((name, key))
    for path, items in by_file.items():
        with open_safetensors(path, str(torch.device(device))) as f:
            for name, key in items:
                names[name].copy_(f.get_tensor(key))


@contextmanager
def filler(model: nn.Module, mapping: dict[str, tuple[str, str]], device):
    """fill(tensor, full) for tpdiag.models.shard_init: copy the checkpoint tensors mapped to
    `tensor` (a tensor of `model` as it is now, e.g. a meta DTensor after the plan) into its
    full tensor, in load()'s order; each file is opened once, lazily. It returns whether the
    checkpoint had the tensor (then what the init rule left there does not matter)."""
    from tpdiag.base.files import open_safetensors

    names = _names(model)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, (path, key) in mapping.items():
        by_file.setdefault(path, []).append((name, key))
    sources: dict[int, list[tuple[str, str]]] = {}
    for path, items in by_file.items():
        for name, key in items:
            sources.setdefault(id(names[name]), []).append((path, key))
    with ExitStack() as stack:
        files: dict = {}

        def fill(t: torch.Tensor, full: torch.Tensor) -> bool:
            for path, key in sources.get(id(t), ()):
                if path not in files:
                    files[path] = stack.enter_context(open_safetensors(path, str(torch.device(device))))
                full.copy_(files[path].get_tensor(key))
            return id(t) in sources

        yield fill
