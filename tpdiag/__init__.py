"""tpdiag: why does TP=4 not match TP=1? Finds the first divergent op, names the cause, confirms it.

`import tpdiag` is cheap: torch and everything heavy load on first use of an attribute.
"""
from __future__ import annotations

_LAZY = {
    "Target": ("tpdiag.models.target", "Target"),
    "capture": ("tpdiag.api.capture", "capture"),
    "load": ("tpdiag.api.load", "load"),
    "builtin_target": ("tpdiag.models.spec", "builtin_target"),
    # train with the invariant kernels on (docs/training.md)
    "invariant": ("tpdiag.api.invariant", "invariant"),
    "clip_grad_norm_": ("tpdiag.api.invariant", "clip_grad_norm_"),
    "accumulate_grads": ("tpdiag.api.invariant", "accumulate_grads"),
    "fix_names": ("tpdiag.api.invariant", "fix_names"),
    "set_deterministic": ("tpdiag.api.determinism", "set_deterministic"),
    "deterministic": ("tpdiag.api.determinism", "deterministic"),
    # the typed errors the public functions raise
    "TpdiagError": ("tpdiag.errors", "TpdiagError"),
    "BadInput": ("tpdiag.errors", "BadInput"),
    "BadType": ("tpdiag.errors", "BadType"),
    "NotCarried": ("tpdiag.errors", "NotCarried"),
    "UnguardedMain": ("tpdiag.errors", "UnguardedMain"),
}


def version() -> str:
    """The installed distribution's version: pyproject.toml's, the one source of truth. A source
    tree that was never installed has no metadata and says so rather than guess."""
    from importlib import metadata

    try:
        return metadata.version("tpdiag")
    except metadata.PackageNotFoundError:
        return "0+unknown (not installed: pip install -e .)"


def __getattr__(name: str):
    if name == "__version__":
        globals()["__version__"] = v = version()  # read once
        return v
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        # kept: importing tpdiag.capture set the package's `capture` to the module itself
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpdiag' has no attribute {name!r}")


__all__ = ["__version__", "Target", "capture", "load", "builtin_target", "invariant", "clip_grad_norm_", "accumulate_grads",
           "fix_names",
           "set_deterministic", "deterministic", "TpdiagError", "BadInput", "BadType", "NotCarried",
           "UnguardedMain"]
