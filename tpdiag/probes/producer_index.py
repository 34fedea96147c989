"""Which modules' records a tensor is the output of, or a view of (module_probes' producer index:
a consumer's input linked to the modules that returned it, a grad_out to its consumers)."""
from __future__ import annotations

import weakref

import torch


def _root(t: torch.Tensor) -> torch.Tensor | None:
    # a view's _base is the tensor owning the storage (never itself a view)
    return getattr(t, "_base", None)


def add_producer(producer, t: torch.Tensor, meta: dict) -> None:
    for key in (t, _root(t)):
        if key is None:
            continue
        hit = producer.get(id(key))
        if hit is None or hit[0]() is not key:
            producer[id(key)] = (weakref.ref(key), [meta])
        elif not any(m is meta for m in hit[1]):
            hit[1].append(meta)


def producers_of(producer, t: torch.Tensor) -> list:
    """The records of the modules whose output `t` is, or is a view of (the same storage)."""
    hit = producer.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    root = _root(t)
    if root is None:
        return []
    hit = producer.get(id(root))
    return hit[1] if hit is not None and hit[0]() is root else []
