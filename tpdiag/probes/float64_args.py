"""An aten op's arguments walked for the float64 oracle's dispatch mode (probes/float64.py): the
tensors among them, and a float64 copy of them. Every op the oracle re-executes passes here, so
the walk is written out for the containers an op schema passes (lists, tuples, dicts) instead of
pytree's generic one; anything else goes to pytree, with the same result."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpdiag.probes.float64_state import _up_dtype


def _map_args(fn, x):
    """tree_map over an aten op's arguments, which are tensors and plain values in lists, tuples and
    dicts: those walked here, anything else (a structseq, a registered node) by pytree itself.
    pytree's generic walk was about half of this dispatch mode's host time, paid on every op."""
    t = type(x)
    if t is tuple:
        return tuple(_map_args(fn, v) for v in x)
    if t is list:
        return [_map_args(fn, v) for v in x]
    if t is dict:
        return {k: _map_args(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list, dict)):
        return tree_map(fn, x)
    return fn(x)


def _tensors(x, out: list) -> list:
    """The tensors of a pytree of an op's arguments or outputs, in tree_flatten's order."""
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            _tensors(v, out)
    elif t is dict:
        for v in x.values():
            _tensors(v, out)
    elif isinstance(x, (tuple, list, dict)):
        out += [v for v in tree_flatten(x)[0] if isinstance(v, torch.Tensor)]
    elif isinstance(x, torch.Tensor):
        out.append(x)
    return out


def _upcast_one(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
        d = _up_dtype(t.dtype)
        return t.detach().to(d) if t.dtype != d else t.detach()
    return t


def upcast(x):
    """A float64 (complex128) copy of every floating (complex) tensor in a pytree; others as is."""
    return tree_map(_upcast_one, x)
