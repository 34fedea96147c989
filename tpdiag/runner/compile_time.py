"""Kernel compile time of one rank: Triton's JIT compiles (or loads from its on-disk cache) a
kernel the first time it is launched with a new specialisation, inside whatever step launched it.
Triton calls `knobs.runtime.jit_cache_hook` just before and `jit_post_compile_hook` just after
each such compile (synchronous mode), so the seconds between the two are the compile, measured
where it happens rather than guessed from a slow first step.

Only where Triton compiles: on a GPU. On the CPU tpdiag's kernels run in Triton's interpreter or
as torch code, and nothing is reported (an absent field, not a zero that reads as measured).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

# the compiled kernels' names a rank's timings keep (rankN.done, the manifest's rank_timings)
MAX_NAMES, NAME_CHARS = 64, 300


@contextmanager
def compile_meter(device_type: str):
    """Yields a dict that holds, when the block ends, `triton_compile_s` and `triton_compiles`
    (empty where nothing was measured). Hooks another user installed are called as before."""
    out: dict = {}
    if device_type != "cuda":
        yield out
        return
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton (or one without knobs): nothing to measure
        yield out
        return
    rt = getattr(knobs, "runtime", None)
    if not (hasattr(rt, "jit_cache_hook") and hasattr(rt, "jit_post_compile_hook")):  # an older Triton
        yield out
        return
    prev_pre, prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
    started: list[float] = []
    total = {"s": 0.0, "n": 0}
    names: list[str] = []
    log = os.environ.get("TPDIAG_COMPILE_LOG")  # a JSON line a compile: which kernel, which specialisation

    def pre(*args, **kwargs):
        # a truthy answer skips the compile: only the hook that was there may say so
        skip = prev_pre(*args, **kwargs) if prev_pre else None
        if not skip:
            started.append(time.perf_counter())
            # which kernel and specialisation (Triton's repr: name, options, argument types): a
            # world that compiles what an earlier world of the run compiled says which (issue 59)
            name = kwargs.get("repr") or getattr(kwargs.get("fn"), "name", None)
            if isinstance(name, str) and len(names) < MAX_NAMES:
                names.append(name[:NAME_CHARS])
        return skip

    def post(*args, **kwargs):
        if started:
            s = time.perf_counter() - started.pop()
            total["s"] += s
            total["n"] += 1
            if log:
                _log(log, s, kwargs)
        return prev_post(*args, **kwargs) if prev_post else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
    try:
        yield out
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = prev_pre, prev_post
        out.update(triton_compile_s=total["s"], triton_compiles=total["n"])
        if names:
            out["triton_kernels"] = names


def _log(path: str, s: float, kwargs: dict) -> None:
    fn = kwargs.get("fn")
    comp = kwargs.get("compile") or {}
    consts = comp.get("constants") or {}
    line = {"pid": os.getpid(), "t": round(time.time(), 3), "s": round(s, 4), "name": getattr(fn, "name", None) or str(fn),
            "key": str(comp.get("key"))[:3000], "signature": str(comp.get("signature"))[:1000],
            "constants": {str(k): repr(v) for k, v in consts.items()}}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:  # a diagnostic: never the run's failure
        pass
