"""A model built on the meta device without its random fills.

On `meta` a tensor has a shape and no values, so `normal_`, `uniform_` and the other in-place random
fills (nn.init's, a module's reset_parameters) change nothing one can read - but torch runs them
through its Python reference (torch._refs.normal, decorated by torch._compile), whose first call
imports torch._dynamo and torch._inductor: ~4 CPU s of imports in a CLI process that builds a
`py:` target on meta to check its plan before any world starts (models/precheck.py), for nothing.
Inside `meta_device()` such a fill of a meta tensor returns the tensor as it is; every other call,
and any fill of a tensor that is not on meta, runs as torch runs it.
"""
from __future__ import annotations

import contextlib

# Tensor methods that fill a tensor in place with random numbers, and nn.init's random fills (each
# reaches the methods from inside its own torch-function handling, which a mode does not see again)
_METHODS = ("normal_", "uniform_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
            "bernoulli_")
_INITS = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
          "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def meta_device():
    """torch.device("meta") for the calls inside, with in-place random fills of meta tensors skipped."""
    import torch
    from torch.overrides import TorchFunctionMode

    fills = {getattr(torch.Tensor, n) for n in _METHODS} | {getattr(torch.nn.init, n) for n in _INITS}

    class _SkipMetaFills(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            t = args[0] if args else kwargs.get("tensor")
            if func in fills and isinstance(t, torch.Tensor) and t.is_meta:
                return t  # what each of them returns: the tensor it filled
            return func(*args, **kwargs)

    with torch.device("meta"), _SkipMetaFills():
        yield
