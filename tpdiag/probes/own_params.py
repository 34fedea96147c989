"""The own-input pass's re-execution from THIS side's parameters (probes/oracle_hooks.record_own_oracles):
a module's subtree's parameters swapped, for the float64 re-execution only, for the values another
world shipped (diff/own_params.py). From step 1 on each side's parameters are its own update's: the
reference's module on this side's inputs was not the function this side computed, and a grad judged by
the root at step 1 was judged against the reference's weights (tests/test_step_params.py)."""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from tpdiag.records.side_params import source_key

# each parameter's (version counter, storage) as its record was taken (mark_recorded: after the init
# and after each update): the value shipped under that record's key is what the next forward read only
# where nothing wrote the parameter since - a max-norm constraint a parent's forward applies in place
# before calling the child (tests/models/planted/drift_llama.py) ran the child on weights that no
# record holds, and the child re-executed from the recorded ones read a correct model BUG at step 1
# (by id, with a weak reference that tells a reused id: a tensor key compares by value)
_RECORDED: dict[int, tuple] = {}


def mark_recorded(model: torch.nn.Module) -> None:
    """Every parameter's version and storage now, as its param (or param_init) record holds it."""
    for p in model.parameters():
        _RECORDED[id(p)] = (weakref.ref(p), _stamp(p))


def _stamp(p) -> tuple:
    t = getattr(p, "_local_tensor", p)  # a DTensor's shard is what an in-place write moves
    return t._version, t.untyped_storage().data_ptr()


def written_since_recorded(mod: torch.nn.Module) -> list[str]:
    """The parameters of mod's subtree written (in place, or replaced) since their records were taken;
    a write through `.data` moves no version counter and is not seen."""
    out = []
    for n, p in mod.named_parameters():
        ref, stamp = _RECORDED.get(id(p), (None, None))
        if ref is not None and ref() is p and stamp != _stamp(p):
            out.append(n)
    return out


def shipped_for(mod: torch.nn.Module, path: str, step: int, tensors: dict) -> dict | None:
    """{parameter: this side's value} for every parameter of mod's subtree, or None where any of them
    was not shipped (none differs at that step, or one could not be: a hash-only record) or does not
    fit (another shape, a DTensor), or one was written since its record (written_since_recorded: the
    shipped value is not what this call read): all of them or none - a partial swap is neither side's
    function."""
    from tpdiag.records.keys import root_record_name

    if written_since_recorded(mod):
        return None
    # the root's own parameters record under its record name ("(root)" above HF's `model` child)
    root = root_record_name(c for c, _ in mod.named_children()) if not path else None
    got, any_shipped = {}, False
    for n, p in mod.named_parameters():
        full = f"{path}.{n}" if path else n
        owner, _, short = full.rpartition(".")
        t = tensors.get(source_key(step, owner or root, short))
        if t is None or hasattr(p, "_local_tensor") or tuple(t.shape) != tuple(p.shape):
            return None
        any_shipped = True
        got[p] = t
    return got if any_shipped else None


@contextmanager
def swapped(params: dict | None):
    """Each parameter's data replaced by this side's value (its dtype and device), restored after."""
    if not params:
        yield
        return
    saved = []
    try:
        with torch.no_grad():
            for p, t in params.items():
                saved.append((p, p.data))
                p.data = t.to(device=p.device, dtype=p.dtype)
        yield
    finally:
        with torch.no_grad():
            for p, d in saved:
                p.data = d
