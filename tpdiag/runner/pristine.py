"""A freshly built model's state, kept so a second run starts from the same bits without a second
build (the world's unprobed self-check run, then its probed run: runner/worker.py).

What a rebuild gave the second run, and what a restore must give it too: every parameter and
buffer (DTensors: this rank's shard) and every tensor a module holds as a plain attribute, bit
for bit; no grads; the torch RNG states right after the build (the build seeded them). What the
restore cannot put back - a module's attribute added, removed or rebound, a container attribute
that grew, a tensor resized or replaced, a parameter or buffer registered or dropped, the
snapshot itself out of memory - makes it refuse (`restore()` says why) and the caller rebuilds:
the second run never starts from a state a fresh build would not have had. What it cannot see -
a nested container mutated in place - would change the step's values, which the self-check
compares, and fail it (closed), never pass it falsely.
"""
from __future__ import annotations

import os

import torch

from tpdiag.base.dtensors import local_of
# torch's own per-module bookkeeping: hook containers (mutated in place by hook registration and
# removal, which probes and fixes undo) and the flag a full backward hook sets once for good
from tpdiag.base.user_state import TORCH_KEYS as _TORCH_KEYS

_SCALARS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


class Pristine:
    """take(model) right after the build; restore() before the second run (None: restored)."""

    def __init__(self, model, tensors: list, attrs: dict, rng: tuple):
        self.model, self._tensors, self._attrs, self._rng = model, tensors, attrs, rng

    @classmethod
    def take(cls, model) -> "Pristine | str":
        """The snapshot, or why there is none (the caller rebuilds instead)."""
        tensors, seen = [], set()
        # test hook (negative controls): a restore that misses the buffers, or the attributes' check
        skip = os.environ.get("TPDIAG_TEST_RESTORE_SKIP", "")

        def keep(where: str, t) -> None:
            if not isinstance(t, torch.Tensor) or id(t) in seen:  # tied: one copy
                return
            seen.add(id(t))
            local = local_of(t)
            tensors.append((where, t, local, tuple(local.shape), local.stride(), local.dtype,
                            local.device, t.requires_grad,
                            local.detach().clone(memory_format=torch.preserve_format)))

        try:
            with torch.no_grad():
                for name, p in model.named_parameters(remove_duplicate=False):
                    keep(name, p)
                for name, b in model.named_buffers(remove_duplicate=False):
                    if skip != "buffers":
                        keep(name, b)
                attrs = {}
                for mname, m in model.named_modules(remove_duplicate=False):
                    attrs[mname] = sig = _signature(m) if skip != "attributes" else None
                    for k, v in vars(m).items():
                        if k in _TORCH_KEYS:
                            continue
                        for i, t in enumerate(_tensors_in(v)):
                            keep(f"{mname}.{k}[{i}]" if mname else f"{k}[{i}]", t)
                    if sig is not None:
                        sig.update(_registered(m))
        except torch.OutOfMemoryError:
            tensors.clear()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return "no room for a copy of the parameters"
        return cls(model, tensors, attrs, _rng_states())

    def restore(self) -> str | None:
        """Put the built state back; None when done, else why not (nothing then is trusted:
        the caller rebuilds)."""
        now = {name: m for name, m in self.model.named_modules(remove_duplicate=False)}
        if set(now) != set(self._attrs):
            return "the model's modules changed"
        for name, m in now.items():
            if self._attrs[name] is None:
                continue
            sig = {**_signature(m), **_registered(m)}
            if sig != self._attrs[name]:
                what = sorted(k for k in set(sig) | set(self._attrs[name])
                              if sig.get(k) != self._attrs[name].get(k))
                return f"module {name or '(root)'}: {', '.join(what)} changed in the run"
        with torch.no_grad():
            for where, t, local, shape, stride, dtype, device, grad, saved in self._tensors:
                now_local = local_of(t)
                if (now_local is not local and now_local.data_ptr() != local.data_ptr()) or \
                        (tuple(local.shape), local.stride(), local.dtype, local.device,
                         t.requires_grad) != (shape, stride, dtype, device, grad):
                    return f"{where}: its tensor was replaced or reshaped in the run"
                try:
                    local.copy_(saved)
                except RuntimeError as e:  # e.g. an expanded (self-overlapping) buffer
                    return f"{where}: {str(e).splitlines()[0]}"
                if t.grad is not None:
                    t.grad = None
        _set_rng_states(self._rng)
        self._tensors = []  # the copies' memory back before the second run
        return None


def _tensors_in(v) -> list:
    """Tensors a module holds as a plain attribute, directly or one container deep."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    if isinstance(v, dict):
        return [x for x in v.values() if isinstance(x, torch.Tensor)]
    return []


def _signature(m) -> dict:
    """A module's plain attributes as the build left them: scalars by value, containers by their
    members' identities, everything else by identity (an attribute rebound or added shows)."""
    out = {}
    for k, v in vars(m).items():
        if k in _TORCH_KEYS:
            continue
        if isinstance(v, _SCALARS):
            out[k] = ("=", type(v), v)
        elif isinstance(v, (list, tuple)):
            out[k] = (type(v), id(v), tuple(id(x) for x in v))
        elif isinstance(v, dict):
            out[k] = (type(v), id(v), tuple((a if isinstance(a, _SCALARS) else id(a), id(b))
                                            for a, b in v.items()))
        else:
            out[k] = (type(v), id(v))
    return out


def _registered(m) -> dict:
    """Which tensor objects a module registers (no attribute is named so)."""
    return {"<params>": tuple((k, id(v)) for k, v in m._parameters.items()),
            "<buffers>": tuple((k, id(v)) for k, v in m._buffers.items())}


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
