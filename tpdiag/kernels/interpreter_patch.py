"""The Triton interpreter (TRITON_INTERPRET=1: the CPU's tests, TPDIAG_TRITON_CPU=1) without
patching triton.language again at every @triton.jit helper call inside a launch.

Triton's interpreter replaces triton.language's builtins with interpreted ones for a launch
(GridExecutor.__call__: once, restored when the launch ends) and again at every call of a jit
helper from the kernel (InterpretedFunction.__call__ -> _patch_lang), each time walking the
language modules with inspect.getmembers. Inside the launch that second patch finds the builtins
already replaced and sets the same wrappers again: it changes nothing, and it was a third of the
interpreter's CPU time in the record-hash kernels (one [1, 8, 64] bf16 shard: 0.51 -> 0.32 s a
launch on the 2-core CPU machine; the hash tests' interpreted script 55 -> 33 s). Here a helper's
patch is skipped when the running launch has already patched the same language modules; any other
patch (a helper whose module sees other language modules, a call outside a launch) is Triton's
own. Nothing changes on a GPU, where the interpreter does not run; where this Triton has not the
internals named here (another release), nothing is changed either.
"""
from __future__ import annotations

import os

_DONE: list = []


def lighten() -> None:
    """Install the skip once per process, under the interpreter only (call after importing triton)."""
    if _DONE or os.environ.get("TRITON_INTERPRET") != "1":
        return
    _DONE.append(True)
    import inspect

    try:
        import triton.language as tl
        import triton.runtime.interpreter as ti
    except ImportError:
        return
    patch_lang = getattr(ti, "_patch_lang", None)
    grid = getattr(getattr(ti, "GridExecutor", None), "__call__", None)
    if patch_lang is None or grid is None or not hasattr(ti, "_LangPatchScope"):
        return
    # per running launch: the language-module sets patched for it, and the functions seen (their
    # module sets worked out once a launch: walking a module's globals at every call cost 3%)
    launches: list[tuple[set, set]] = []

    def _patch_lang(fn):
        if not launches:
            return patch_lang(fn)
        patched, seen = launches[-1]
        if fn in seen:
            return ti._LangPatchScope()  # already in place for this launch: nothing to undo either
        key = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        seen.add(fn)
        if key in patched:
            return ti._LangPatchScope()
        patched.add(key)
        return patch_lang(fn)

    def _grid_call(self, *args, **kwargs):
        launches.append((set(), set()))
        try:
            return grid(self, *args, **kwargs)
        finally:
            launches.pop()

    ti._patch_lang = _patch_lang
    ti.GridExecutor.__call__ = _grid_call
    _memo_np_dtype(ti, tl)


def _memo_np_dtype(ti, tl) -> None:
    """The interpreter's _get_np_dtype (a Triton dtype -> the numpy dtype holding its values, looked
    up at every interpreted op's result) built its 19-entry table on every call: 8% of the record
    hash kernels' interpreted time under cProfile (384k calls). Its answers per element type,
    remembered from Triton's own function: a pointer, or a block of pointers, is uint64 as there;
    a block is its element type's; an unknown type raises as there (and is not remembered)."""
    get_np = getattr(ti, "_get_np_dtype", None)
    if get_np is None or not hasattr(tl, "pointer_type") or not hasattr(tl, "block_type"):
        return
    table: dict = {}

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return get_np(tt_dtype)
        ty = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(ty, tl.pointer_type):
            return get_np(tt_dtype)
        try:
            return table[ty]
        except KeyError:
            got = table[ty] = get_np(ty)
            return got

    ti._get_np_dtype = _get_np_dtype
