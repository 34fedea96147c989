"""The own-input pass's re-execution from THIS side's parameters (probes/oracle_hooks.record_own_oracles):
a module's subtree's parameters swapped, for the float64 re-execution only, for the values another
world shipped (diff/own_params.py). From step 1 on each side's parameters are its own update's: the
reference's module on this side's inputs was not the function this side computed, and a grad judged by
the root at step 1 was judged against the reference's weights (tests/test_step_params.py)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from tpdiag.records.side_params import source_key


def shipped_for(mod: torch.nn.Module, path: str, step: int, tensors: dict) -> dict | None:
    """{parameter: this side's value} for every parameter of mod's subtree, or None where any of them
    was not shipped (none differs at that step, or one could not be: a hash-only record) or does not
    fit (another shape, a DTensor): all of them or none - a partial swap is neither side's function."""
    from tpdiag.records.keys import root_record_name

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
