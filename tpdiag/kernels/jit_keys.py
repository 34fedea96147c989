"""One on-disk cache key per Triton kernel, whatever order a process launches its kernels in.

Triton 3.6 keys a kernel on a hash of its source and of the @triton.jit helpers it calls; a
helper's hash is worked out once, inside whichever kernel asked first, and the kernel that asks
second gets another key. Two processes that launch `_hash_kernel` and `_hash_batch_kernel` in
other orders (a world that hashes queued records first, one that hashes a record alone first)
store the same compiled kernel under two keys and neither finds the other's: an H200 world
recompiled, 1-2.5 s each, variants another world (or runner/warm.py) had just stored (`python -c`
on an H200: `_hash_kernel.cache_key` 7898... asked first, 76e7... after `_hash_batch_kernel`;
Triton 3.9 gives one key either way). Asking every function of a kernel module for its key once,
in definition order, when the module is imported makes every process key them alike.
"""
from __future__ import annotations


def settle(namespace: dict) -> None:
    """Work out the cache key of every Triton JIT function in `namespace` (a module's globals()),
    in definition order. The interpreter's functions (TRITON_INTERPRET=1) have no disk cache:
    nothing to do there."""
    for value in list(namespace.values()):
        if type(value).__name__ != "JITFunction":
            continue
        try:
            value.cache_key
        except Exception:  # noqa: BLE001 - a key Triton cannot work out now is worked out at launch
            pass
