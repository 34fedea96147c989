"""Which ops of a float64 re-execution (probes/float64.py) let a tensor's VALUES decide a shape: an op
whose output shape is data-dependent (nonzero, a boolean mask's index, unique, repeat_interleave by a
tensor, bincount - torch's own `dynamic_output_shape` tag), or one that hands a value to Python
(`.item()`, `int(t)`, `bool(t)`, `torch.equal`, `.tolist()`, `.numpy()`), from where the code may size,
slice or branch by it. A rounding difference can change a shape only through one of these: where the
reference's code computing a record ran none, that record's shape is a function of its inputs'
shapes alone (diff/shape_break.py reads the note).

`.tolist()`, `.numpy()` and `__array__` read the data without dispatching an op (no TorchDispatchMode
sees them): a TorchFunctionMode notes those. Conservative on purpose: a noted op only leaves a shape
break `unknown` (never a false BUG); an op missed here could call a flip a bug."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# the Tensor methods that read its data into Python without an aten op
_READS = {"tolist", "numpy", "__array__"}


# namespaces whose ops say by their tags whether a value decides their output's shape; a custom op of
# any other (a user's fused MoE dispatch, `mylib::permute_tokens`) may size its output by its routing
# and say nothing: counted as one (conservative). tpdiag's own (kernels/attention.py) keep q's shape.
_TAGGED = ("aten", "prims", "_c10d_functional", "c10d", "tpdiag")


def value_shaped(func, args, kwargs) -> bool:
    """Whether this op's output shape, or the Python value it returns, may depend on its inputs' values."""
    if getattr(func, "namespace", "aten") not in _TAGGED:
        return True
    tags = func.tags
    name = func.overloadpacket.__name__
    if torch.Tag.data_dependent_output in tags or name in ("equal", "is_nonzero"):
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if name in ("index", "_unsafe_index"):
        # x[idx] with integer indices has idx's shape; only a boolean mask's count is a value
        idx = args[1] if len(args) > 1 else kwargs.get("indices") or ()
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx)
    if name == "one_hot":
        n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return n is None or n < 0  # without num_classes its width is the largest value + 1
    return True


class ValueReads(TorchFunctionMode):
    """Notes the Tensor methods that read data into Python without dispatching an op."""

    def __init__(self, into: list[str]):
        super().__init__()
        self.into = into

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS and f"Tensor.{name}" not in self.into:
            self.into.append(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))
