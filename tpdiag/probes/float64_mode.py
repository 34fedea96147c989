"""The float64 oracle's dispatch mode (probes/float64.py): every aten op of a re-executed call
handed float64 copies of its floating inputs, its dtype arguments rewritten to float64; an op that
draws random numbers or writes state the oracle did not make refused, and the discrete choices made
on floating values noted (a choice no rounding of the working precision could flip is not), with the
indices each such choice chose (diff/choices_made.py holds them to the side's own records)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tpdiag.probes.float64_args import _map_args, _tensors, _upcast_one, upcast
from tpdiag.probes.float64_state import F64, _up_dtype
from tpdiag.probes.value_shapes import value_shaped

# ops that make a discrete choice from floating values: a rounding-level difference before one
# can flip it (an MoE router's top-k, a threshold) and move the output by O(1) without any bug
DISCRETE = {"topk", "sort", "argsort", "argmax", "argmin", "max", "min", "kthvalue", "mode",
            "median", "nanmedian", "searchsorted", "bucketize", "gt", "lt", "ge", "le", "eq", "ne",
            "unique", "_unique2", "msort"}


class OracleRefused(Exception):
    """The call cannot be re-executed as a pure function of its inputs (the reason is the text)."""


def op_name(func) -> str:
    return f"{getattr(func, 'namespace', 'aten')}::{func.overloadpacket.__name__}"


def _written(func, args, kwargs) -> list:
    """The tensors an op writes (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        flat, _ = tree_flatten(v)
        out += [t for t in flat if isinstance(t, torch.Tensor)]
    return out


class Float64Mode(TorchDispatchMode):
    """Every op in float64; `owned` are the storages the oracle made (it may write those)."""

    def __init__(self, protected: set[int], working: torch.dtype | None = None, known: set[int] | None = None):
        super().__init__()
        self.protected = protected  # data_ptrs of the module's parameters and buffers
        self.discrete: list[str] = []  # choices made on floating values (topk, argmax, x > y)
        # the precision the module really ran in: how close two values must be for its own
        # rounding to order them otherwise than float64 does (None: every choice counts)
        self.working = working
        # the storages the call may read as its own (its input snapshot, its parameters, buffers
        # and tensor attributes, what its ops made); None: not watched. Any other storage an op
        # reads is state from outside its inputs - another module's buffer, a tensor kept in a
        # shared object or a global (`foreign`, storage ptr -> tensor): a value its input records do
        # not hold (diff/written_state.py reads which)
        self.known = known
        self.foreign: dict[int, torch.Tensor] = {}
        # a max/min/topk's choice is its INDICES: its values are a continuous function of the input
        # (a flipped near tie moves them by the gap, itself rounding) - a softmax's `x - x.max(-1)
        # .values` (HF gpt-oss attention, with its sinks) chooses nothing. So an unclear choice
        # counts once its indices are read by a later op or returned (`consumed`); held here (the
        # tensor kept alive: its storage not reused) until then. An argmax's output is its indices.
        self.pending: dict[int, tuple[str, torch.Tensor]] = {}
        # the indices each unclear choice read chose, in the order they were read (hashed once the
        # call is done: probes/float64.module_oracle); `untold` the discrete ops whose choice holds no
        # indices (a comparison, a sort): diff/choices_made.py holds them to the side's integer records
        self.chosen: list[torch.Tensor] = []
        self.untold: list[str] = []
        # ops through which a value may decide a shape (probes/value_shapes.py): where a forward ran
        # none, its outputs' shapes follow from its inputs' shapes alone (diff/shape_break.py)
        self.shaped: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        # a select op is read at every call, noted or not: each call's choice is hashed (chosen)
        choice = name in DISCRETE and (name in _SELECT or op_name(func) not in self.discrete) and any(
            isinstance(a, torch.Tensor) and a.is_floating_point() for a in tree_flatten(args)[0])
        if choice and name not in _SELECT:
            self.discrete.append(op_name(func))
            self.untold.append(op_name(func))
            choice = False
        if torch.Tag.nondeterministic_seeded in func.tags and not _sdpa_without_dropout(func, args, kwargs):
            raise OracleRefused(f"it draws random numbers ({op_name(func)}): its output is not a "
                                "function of its inputs")
        if func._schema.is_mutable:
            for t in _written(func, args, kwargs):
                if t.dtype != _up_dtype(t.dtype) or storage_ptr(t) in self.protected:
                    raise OracleRefused(f"it writes state in place ({op_name(func)} on a "
                                        f"{str(t.dtype).replace('torch.', '')} tensor it did not "
                                        "create): re-running it would change the real run")
        if self.pending:
            self.consumed((args, kwargs))
        if op_name(func) not in self.shaped and value_shaped(func, args, kwargs):
            self.shaped.append(op_name(func))
        if self.known is not None and not name.startswith("lift_fresh"):  # torch.tensor(3.0): made here
            for t in _tensors((args, kwargs), []):
                p = storage_ptr(t)
                if p > 0 and p not in self.known and p not in self.foreign:
                    self.foreign[p] = t
        sch = func._schema.arguments
        args = list(args)
        for i, a in enumerate(args):
            if i < len(sch) and "ScalarType" in str(sch[i].type):
                args[i] = _up_dtype(a)
        kwargs = {k: (_up_dtype(v) if k in ("dtype", "out_dtype") else v) for k, v in kwargs.items()}
        if name == "_grouped_mm":
            out = _grouped_mm64(*upcast(tuple(args)), **upcast(kwargs))
            if self.known is not None:
                self.known.add(storage_ptr(out))
            return out
        up_args, up_kwargs = _map_args(_upcast_one, tuple(args)), _map_args(_upcast_one, kwargs)
        out = func(*up_args, **up_kwargs)
        if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()) \
                and out.dtype != _up_dtype(out.dtype) and not _tensors((args, kwargs), []):
            # a factory given no dtype (`torch.zeros(n)`) makes the default dtype: float32 here
            # would make every later op see a float64 COPY of it, so the module's own in-place
            # fill of it (`load[e] = ...`, an index_add_ into an accumulator) went to the copy and
            # was lost without a word
            out = out.to(_up_dtype(out.dtype))
        if self.known is not None:
            self.known.update(p for t in _tensors(out, []) if (p := storage_ptr(t)) > 0)
        if choice and not _clear_choice(func, up_args, up_kwargs, self.working):
            idx = _indices(out)
            if idx is None:
                if op_name(func) not in self.discrete:
                    self.discrete.append(op_name(func))
                if op_name(func) not in self.untold:
                    self.untold.append(op_name(func))
            else:
                self.pending[storage_ptr(idx)] = (op_name(func), idx)
        return out

    def consumed(self, tree) -> None:
        """The pending choices whose indices `tree` (an op's arguments, the call's output) holds
        become discrete choices made."""
        for t in _tensors(tree, []):
            got = self.pending.pop(storage_ptr(t), None)
            if got is None:
                continue
            if got[0] not in self.discrete:
                self.discrete.append(got[0])
            self.chosen.append(got[1])


# index-selecting ops whose choice can be checked for a near tie (_clear_choice)
_SELECT = {"max", "min", "argmax", "argmin", "topk"}


def _indices(out) -> torch.Tensor | None:
    """The integer indices a select op returned (max.dim/min.dim/topk: (values, indices); argmax:
    the indices), or None (a whole-tensor max: a value, but kept conservative by the caller)."""
    if isinstance(out, torch.Tensor):
        return out if not out.is_floating_point() and not out.is_complex() and storage_ptr(out) > 0 else None
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], torch.Tensor) \
            and out[1].dtype == torch.int64 and storage_ptr(out[1]) > 0:
        return out[1]
    return None
# a choice is clear when the values it picks between are further apart, relative to the largest
# of them, than this many unit roundoffs of the working precision: the module's own rounding
# (from the same inputs: an oracle from this side's inputs) cannot reorder them. A router's
# matmul and softmax in fp32 move a value by tens of roundoffs, not thousands.
_CLEAR_ROUNDOFFS = 2.0 ** 12


def _clear_choice(func, args, kwargs, working) -> bool:
    """True when a max/min/argmax/argmin/topk along a dim picked values no rounding of the
    working precision could have ordered otherwise: the gap between each row's chosen value and
    the next candidate (the k-th and (k+1)-th for topk, and between the chosen ones) is beyond
    _CLEAR_ROUNDOFFS unit roundoffs of the row's largest magnitude. Any other form (a whole-tensor
    max is a value, not a choice - but kept conservative), or an error: False."""
    if working is None or not (working.is_floating_point and working != F64):
        return False
    try:
        x = args[0]
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
            return False
        base = func.overloadpacket.__name__
        schema = [a.name for a in func._schema.arguments]
        if "dim" not in schema:
            return False
        named = dict(zip(schema, args))
        named.update(kwargs)
        if base == "topk":
            k = int(named["k"])
            largest = bool(named.get("largest", True))
        else:
            if named.get("dim") is None:
                return False
            k, largest = 1, base in ("max", "argmax")
        d = int(named.get("dim", -1))
        v = x.movedim(d, -1)
        if v.shape[-1] <= k:
            return v.shape[-1] == k and base == "topk"  # nothing left out; order among them is all
        top = torch.topk(v if largest else -v, k + 1, dim=-1).values
        gaps = (top[..., :-1] - top[..., 1:]).abs()
        # the magnitude rounding scales with is the finite values': a masked -inf (a router's
        # excluded experts, a causal mask) is no value any rounding moves, and as the scale it made
        # every gap in its row "too small" (tests/test_attn_sinks.py)
        scale = v.abs().masked_fill(~v.isfinite(), 0).amax(-1, keepdim=True)
        u = torch.finfo(working).eps / 2
        if base != "topk":
            gaps = gaps[..., -1:]
        return bool((gaps > _CLEAR_ROUNDOFFS * u * scale).all())
    except Exception:  # noqa: BLE001 - a form this check does not read counts as a choice
        return False


def _grouped_mm64(a, b, offs=None, bias=None, out_dtype=None):
    """aten::_grouped_mm in float64, which its kernel refuses: MoE experts in transformers 5.24 run
    each expert's rows through it. 2-D a [M, K] x 3-D b [G, K, N] with offs (each group's end row)
    is one matmul per group of rows; 3-D x 3-D is a batched matmul. Other forms are refused."""
    if bias is not None or a.dim() + b.dim() not in (5, 6) or (a.dim() == 2) != (offs is not None):
        raise OracleRefused("aten::_grouped_mm in a form the float64 oracle does not re-execute")
    if a.dim() == 3:
        return torch.bmm(a, b)
    out = a.new_zeros((a.shape[0], b.shape[-1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (meta, a subclass): never one of ours
        return -1


def _sdpa_without_dropout(func, args, kwargs) -> bool:
    """An SDPA kernel is tagged as drawing random numbers for its dropout; with dropout_p 0 it
    draws none and is a function of its inputs."""
    if not func.overloadpacket.__name__.startswith("_scaled_dot_product_"):
        return False
    names = [a.name for a in func._schema.arguments]
    got = dict(zip(names, args))
    got.update(kwargs or {})
    return float(got.get("dropout_p") or 0.0) == 0.0
