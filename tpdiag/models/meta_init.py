"""Materialise a model built on the meta device directly on the run's device, with an init that
depends only on (seed, module fqn, the module's own shapes and dtypes, its init rule).

Building the whole model on the CPU of every rank first (seeded global RNG, module order) is
what made a 4B world take minutes. Here the model is built on `meta` (no memory, no init), each
tensor is allocated on the run's device, and every module is initialised by its own rule with
the RNG reseeded from (seed, that module's fqn) - never a stream shared in build order. So the
weights do not depend on build order, on which other modules exist, on the degree or the rank:
TP=1 and TP=N hold bitwise the same full tensors, which the TP world shards afterwards.

Random numbers come from the device's generator: the CUDA generator gives other numbers than
the CPU one (and CUDA's depend on the GPU model: its kernels split the stream by SM count).
That is fine for tpdiag - every degree of one run is on the same device type and GPU model -
but a CPU run and a GPU run of the same seed start from different weights.

Every tensor allocated here is first filled with NaN (floating point) and checked after the
init rules ran: a tensor no rule filled is an error naming it, never uninitialised memory.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import nn

from tpdiag.errors import BadInput

InitFn = Callable[[str, nn.Module], None]


def stream_seed(seed: int, fqn: str) -> int:
    """The RNG seed of module `fqn`'s init: a hash, so neighbouring fqns get unrelated streams."""
    d = hashlib.sha256(f"tpdiag-init\0{int(seed)}\0{fqn}".encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)


def reset_parameters_rule(fqn: str, module: nn.Module) -> None:
    """torch's convention: a module's `reset_parameters()` initialises its own parameters."""
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        fn()


def _post_order(model: nn.Module):
    """(fqn, module) children before parents (as transformers' init visits them), each once."""
    seen: set[int] = set()
    out = []

    def walk(prefix: str, mod: nn.Module):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for name, child in mod.named_children():
            walk(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, mod))

    walk("", model)
    return out


def nan_like(t: torch.Tensor, device) -> torch.Tensor:
    """Storage for `t` on `device`, NaN where floating point: a tensor no init rule fills is
    then seen (check_initialised), never uninitialised memory."""
    data = torch.empty(t.shape, dtype=t.dtype, device=device)
    if data.is_floating_point() or data.is_complex():
        data.fill_(float("nan"))
    return data


def _allocate(model: nn.Module, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Give every meta parameter and buffer storage on `device` (NaN-filled); move the others.
    A tensor shared by two modules (tied weights) stays one tensor. Returns what was allocated."""
    new: dict[int, torch.Tensor] = {}
    allocated = []
    for prefix, mod in _post_order(model):
        for slot in ("_parameters", "_buffers"):
            table = getattr(mod, slot)
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in new:
                    if t.is_meta:
                        data = nan_like(t, device)
                    else:
                        data = t.detach().to(device)
                    if isinstance(t, nn.Parameter):
                        data = nn.Parameter(data, requires_grad=t.requires_grad)
                    if t.is_meta:
                        allocated.append((f"{prefix}.{name}" if prefix else name, data))
                    new[id(t)] = data
                table[name] = new[id(t)]
    return allocated


def materialize(model: nn.Module, device, seed: int, init_module: InitFn,
                loaded: frozenset[str] = frozenset()) -> nn.Module:
    """Allocate `model`'s meta tensors on `device` and run `init_module(fqn, module)` for every
    module, children first, with the RNG reseeded from (seed, fqn) before each. The rule fills
    the module's own parameters and buffers (recomputed buffers such as rotary tables too).
    The global RNG state is restored afterwards. Raises BadInput naming a tensor left unfilled,
    except the tensors named in `loaded` (the caller copies a checkpoint's into them next)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    allocated = _allocate(model, device)
    cuda = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        for fqn, mod in _post_order(model):
            s = stream_seed(seed, fqn)
            # the CPU generator alone (the device's CUDA one below): torch.manual_seed also queued
            # a lazy seed of every other backend, with a formatted stack each, per module of every
            # build on a CPU rank (~0.3 ms a module at a rank's stack depth; 31 in a TP=2 rank)
            torch.default_generator.manual_seed(s)
            if cuda:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(s)
            init_module(fqn, mod)
    check_initialised(model, allocated, loaded)
    return model


def check_initialised(model: nn.Module, allocated, loaded: frozenset[str] = frozenset()) -> None:
    """No meta tensor left anywhere, and no NaN (the allocation's fill) in what was allocated,
    except in the tensors named in `loaded` (a tied tensor by any of its names)."""
    named = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if t is not None and t.is_meta:
            raise BadInput(f"{name}: still on the meta device after initialisation")
    live = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    skip = {id(t) for name, t in named if name in loaded}
    for name, t in allocated:
        if id(t) not in live or id(t) in skip:  # replaced by its rule (module.weight = ...), or the
            continue                            # checkpoint's: nothing left to fill
        if (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()):
            raise BadInput(f"{name}: not initialised by its module's init rule (a meta-built model "
                           "must have every parameter and buffer filled by its rule: "
                           "docs/models.md, 'Meta-device build')")
