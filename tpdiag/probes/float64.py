"""The float64 oracle: a module's own forward, or one aten op, re-executed in float64.

Why it decides "bug or rounding" for any module: a reordering (a sum split over ranks, another
GEMM blocking, another reduction tree) computes the SAME function of the same inputs, so both
the reference and TP=N land within rounding of the exact value, which float64 approximates
2**29 (fp32) to 2**45 (bf16) times more closely than either side's working precision. A bug
computes ANOTHER function (a norm over a shard, a bias added N times, a shifted position) and
lands far from it while the reference stays close. tpdiag/diff/oracle.py turns the two
distances into the verdict.

How: the call runs under `Float64Mode`, a TorchDispatchMode that hands every aten op float64
copies of its floating inputs (complex128 for complex) and rewrites every floating dtype
argument to float64, so code that casts on its own (`x.float()`, `.to(weight.dtype)`,
`softmax(dtype=torch.float32)`, a `torch.zeros(..., dtype=torch.bfloat16)` buffer) stays in
float64; a factory given no dtype (`torch.zeros(n)`) makes float64 too. Parameters are upcast where an op reads them: no copy of the module is made. The
module runs as the reference world runs it (TP=1: its collectives over a group of one).

Refused, with the reason recorded instead of a value: an op that draws random numbers (its
result is not a function of the inputs; checked before it runs, so no RNG state is consumed),
an op that writes a tensor the oracle did not create (a buffer, a parameter, a cache: re-running
it would change the real run), and any error the re-execution raises.

The re-execution never changes what the probed model computes (`_isolated`): state the dispatch
mode cannot see as a write is put back - an attribute or buffer the module assigns anew (a
RoPE cache rebuilt in float64), the Python state of the user's code (a counter in a global of
the model's file or in a dict the module holds: base/user_state.py), and the gradient-accumulation window the fixes' Functions add
their weight grads into (kernels/grad_carry.py; the oracle's backward would add its float64
grads to the step's carries, and so to the real .grad, and return none of its own).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# the buffers a forward writes, started from their values before it (probes/float64_state.py)
from tpdiag.probes.float64_taps import tapping as _tapping
from tpdiag.probes.float64_state import F64, _as_before, _up_dtype, _written_values, buffers_before  # noqa: F401
from tpdiag.probes.float64_args import _map_args, _tensors, _upcast_one

_MAX_WHY = 300
# ops that make a discrete choice from floating values: a rounding-level difference before one
# can flip it (an MoE router's top-k, a threshold) and move the output by O(1) without any bug
DISCRETE = {"topk", "sort", "argsort", "argmax", "argmin", "max", "min", "kthvalue", "mode",
            "median", "nanmedian", "searchsorted", "bucketize", "gt", "lt", "ge", "le", "eq", "ne",
            "unique", "_unique2", "msort"}


class OracleRefused(Exception):
    """The call cannot be re-executed as a pure function of its inputs (the reason is the text)."""


def upcast(x):
    """A float64 (complex128) copy of every floating (complex) tensor in a pytree; others as is."""
    return tree_map(_upcast_one, x)


def snapshot(x):
    """As upcast, but always a private copy: the module may later change its input in place."""
    def one(t):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return t.detach().to(_up_dtype(t.dtype), copy=True)
        if isinstance(t, torch.Tensor):
            return t.detach().clone()
        return t

    return tree_map(one, x)


def _op_name(func) -> str:
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        choice = name in DISCRETE and _op_name(func) not in self.discrete and any(
            isinstance(a, torch.Tensor) and a.is_floating_point() for a in tree_flatten(args)[0])
        if choice and name not in _SELECT:
            self.discrete.append(_op_name(func))
            choice = False
        if torch.Tag.nondeterministic_seeded in func.tags and not _sdpa_without_dropout(func, args, kwargs):
            raise OracleRefused(f"it draws random numbers ({_op_name(func)}): its output is not a "
                                "function of its inputs")
        if func._schema.is_mutable:
            for t in _written(func, args, kwargs):
                if t.dtype != _up_dtype(t.dtype) or _ptr(t) in self.protected:
                    raise OracleRefused(f"it writes state in place ({_op_name(func)} on a "
                                        f"{str(t.dtype).replace('torch.', '')} tensor it did not "
                                        "create): re-running it would change the real run")
        if self.known is not None and not name.startswith("lift_fresh"):  # torch.tensor(3.0): made here
            for t in _tensors((args, kwargs), []):
                p = _ptr(t)
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
                self.known.add(_ptr(out))
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
            self.known.update(p for t in _tensors(out, []) if (p := _ptr(t)) > 0)
        if choice and not _clear_choice(func, up_args, up_kwargs, self.working):
            self.discrete.append(_op_name(func))
        return out


# index-selecting ops whose choice can be checked for a near tie (_clear_choice)
_SELECT = {"max", "min", "argmax", "argmin", "topk"}
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
        scale = v.abs().amax(-1, keepdim=True)
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


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (meta, a subclass): never one of ours
        return -1


def _why(e: BaseException) -> str:
    if isinstance(e, OracleRefused):
        return str(e)
    msg = " ".join(str(e).split())
    if len(msg) > _MAX_WHY:
        msg = msg[:_MAX_WHY] + "..."
    return f"its float64 re-execution raised {type(e).__name__}: {msg}"


@contextmanager
def _isolated(mod: torch.nn.Module, buffers=None):
    """The re-execution of mod with the step's state out of its reach: no carry window open, and
    every submodule's attributes, parameters and buffers as they were before, by identity. The
    user's Python state (buffers.py: probes/float64_state.Before) runs as it was before the real
    forward and is put back after: a counter the real call advanced is not advanced twice."""
    from tpdiag.fixes.attention import exact_attention
    from tpdiag.kernels.grad_carry import suspended

    from tpdiag.base.user_state import put_back, take

    mods = list(mod.modules())
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in mods]
    # the user's Python state beside them: a call counter in a global or in a dict the module
    # holds, which a second run of the forward would advance for the real run's next call
    kept = take(mods)
    from tpdiag.base import grad_hook_state

    hooks = grad_hook_state.take(mods)  # a forward that registers a grad hook registered it again
    try:
        if getattr(buffers, "py", None) is not None:
            put_back(buffers.py)
        with suspended(), exact_attention(), warnings.catch_warnings():
            # a composite op (rms_norm, layer_norm) sees the float64 input beside the float32
            # weight before the mode upcasts it and warns it cannot use its fused kernel; the
            # decomposed ops it falls back to run in float64, so the warning is only noise in the
            # user's output
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            yield
    finally:
        for m, attrs, params, bufs in saved:
            for d, was in ((m.__dict__, attrs), (m._parameters, params), (m._buffers, bufs)):
                for k in [k for k in d if k not in was]:
                    del d[k]
                for k, v in was.items():
                    if d.get(k, d) is not v:
                        d[k] = v
        put_back(kept)
        grad_hook_state.put_back(hooks)


def working_dtype(mod: torch.nn.Module) -> torch.dtype | None:
    """The least precise floating dtype the module's parameters and buffers hold (its working
    precision for the choices it makes); None for a module with no floating tensor, or under
    autocast (the ops' inputs are cast on the fly: no one dtype of the module says it)."""
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        return None
    ds = {t.dtype for t in list(mod.parameters()) + list(mod.buffers()) if t.is_floating_point()}
    return max(ds, key=lambda d: torch.finfo(d).eps) if ds else None


def module_oracle(mod: torch.nn.Module, args, kwargs, buffers=None, names=None) -> tuple[object | None, dict]:
    """(the module's output computed in float64 from float64 copies of args/kwargs, notes) or
    (None, {"why": why not}). args/kwargs should be a `snapshot` taken before the real forward
    ran, buffers its `buffers_before` list (the buffers it wrote start from their values before it);
    notes["discrete"] lists the discrete choices on floating values it made, notes["written"] the
    float64 values it left in those buffers (_written_values).
    names: {storage ptr: path} of the model's buffers and parameters, where the state the call read
    from outside its inputs and its own subtree is wanted: notes["reads"] the paths of other
    modules' buffers it read, notes["reads_unnamed"] how many other outside tensors (kept in a
    shared object or a global: what they hold is not known). Another module's parameter is no note
    (parameters are compared as records of their own)."""
    protected = {_ptr(t) for t in list(mod.parameters()) + list(mod.buffers())}
    mode = Float64Mode(protected, working_dtype(mod))
    mine = {_ptr(b) for b in mod.buffers()}  # before _as_before swaps them for their copies
    try:
        with _isolated(mod, buffers), torch.no_grad():
            swapped = _as_before(buffers)
            if names is not None:
                # a tensor attribute that is another module's buffer (`self.amax = observer.amax`) is
                # that buffer, read: never the call's own state
                mode.known = _own_storages(mod, (args, kwargs)) - (set(names["buffers"]) - mine)
            with mode:
                out = mod(*args, **kwargs)
            written = _written_values(mod, swapped)
    except Exception as e:  # noqa: BLE001 - any failure is a reason, never a crash of the run
        return None, {"why": _why(e)}
    notes = {"discrete": mode.discrete} if mode.discrete else {}
    if names is not None and mode.foreign:
        params = names.get("params", {})
        bufs = sorted({names["buffers"][p] for p in mode.foreign if p in names["buffers"]})
        unnamed = sum(1 for p in mode.foreign if p not in names["buffers"] and p not in params)
        if bufs:
            notes["reads"] = bufs
        if unnamed:
            notes["reads_unnamed"] = unnamed
    if written:
        notes["written"] = written  # tensors: taken out by the caller, never kept as a note
    return out, notes


def _own_storages(mod: torch.nn.Module, inputs) -> set[int]:
    """The storages a call of mod reads as its own: its inputs (the snapshot), the parameters,
    buffers and plain tensor attributes of its subtree (as they are after _as_before)."""
    got = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    got += list(mod.parameters()) + list(mod.buffers())
    for m in mod.modules():
        got += [v for v in m.__dict__.values() if isinstance(v, torch.Tensor)]
    return {p for t in got if (p := _ptr(t)) > 0}


def state_names(model: torch.nn.Module) -> dict:
    """{"buffers": {storage ptr: path}, "params": {storage ptr: path}} of a model (module_oracle's
    names): a buffer read by a module that does not hold it is named by its path in the model."""
    bufs = {_ptr(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    params = {_ptr(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return {"buffers": {p: n for p, n in bufs.items() if p > 0},
            "params": {p: n for p, n in params.items() if p > 0}}


def module_oracle_grads(mod: torch.nn.Module, args, kwargs, grad_out, buffers=None,
                        taps: dict | None = None) -> tuple[dict | None, dict]:
    """({direct parameter name: d loss / d param, "inI": d loss / d input I}, notes) in float64
    for one call of `mod`, whose output's grad was `grad_out`: the module's forward again in
    float64 from its input snapshot, with float64 leaf copies of its own (direct) parameters,
    then autograd back from grad_out. Children's parameters are theirs to judge.
    taps: {submodule: its record name}: the grads of those submodules' outputs in this backward
    too, as "tap:NAME:J:O" (the submodule's J-th call inside this one, its O-th output tensor) - the
    exact value of an output grad that leaves a child by code of this module's own
    (`h * sigmoid(gate(h))`), which no module consumer's backward makes (diff/enclosing.py).
    (None, {"why": ...}) when refused."""
    from torch.func import functional_call

    own = {n: p for n, p in mod.named_parameters(recurse=False) if p.requires_grad}
    protected = {_ptr(t) for t in list(mod.parameters()) + list(mod.buffers())}
    leaves = {n: p.detach().to(_up_dtype(p.dtype), copy=True).requires_grad_(True) for n, p in own.items()}
    # the children's parameters as float64 constants: no grad of theirs is asked for, so no
    # Function computes one (a fix's Function would return it in float64 for a float32 weight,
    # which autograd refuses) and nothing reaches the real weights
    frozen = {n: p.detach().to(_up_dtype(p.dtype)) for n, p in mod.named_parameters()
              if n not in own and (p.is_floating_point() or p.is_complex())}
    # its floating inputs too (the snapshot's own copies): d loss / d input, in input order
    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    for i, t in enumerate(ins):
        if t.is_floating_point() or t.is_complex():
            leaves[f"in{i}"] = t.requires_grad_(True)
    if not leaves and not taps:
        return None, {}
    mode = Float64Mode(protected, working_dtype(mod))
    tapped: list = []  # ("tap:NAME:J:O", the child's output in the float64 graph, its version then)
    try:
        g = upcast(grad_out.detach())
        # the backward runs under the mode too: its formulas read what the forward saved
        with _isolated(mod, buffers), torch.enable_grad(), _tapping(mod, taps, tapped):
            _as_before(buffers)
            with mode:
                out = functional_call(mod, {**frozen, **leaves}, args, kwargs, strict=False)
                flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                        and (t.is_floating_point() or t.is_complex()) and t.requires_grad]
                if len(flat) != 1:
                    return None, {"why": "its float64 re-execution has not exactly one differentiable output"}
                # an output the parent then changed in place: the grad autograd gives is the changed
                # value's, not the recorded output's (its hook saw the value before) - not tapped
                tapped = [(k, t) for k, t, v in tapped if t._version == v]
                got = torch.autograd.grad(flat[0], list(leaves.values()) + [t for _, t in tapped],
                                          g.to(flat[0].dtype), allow_unused=True)
    except Exception as e:  # noqa: BLE001
        return None, {"why": _why(e)}
    names = list(leaves) + [k for k, _ in tapped]
    grads = {n: t.detach() for n, t in zip(names, got) if t is not None}
    return grads, ({"discrete": mode.discrete} if mode.discrete else {})


def op_oracle(func, args, kwargs) -> tuple[object | None, str | None]:
    """(one aten op's output in float64, None) or (None, why not); called from inside a dispatch
    mode's handler, so the op runs below every mode."""
    name = _op_name(func)
    base = func.overloadpacket.__name__
    if base.startswith("_scaled_dot_product_") and base != "_scaled_dot_product_attention_math":
        return _sdpa_oracle(func, args, kwargs or {})
    if func.overloadpacket.__name__ in DISCRETE:
        return None, f"{name} makes a discrete choice (its float64 value is no rounding reference)"
    if torch.Tag.nondeterministic_seeded in func.tags:
        return None, f"{name} draws random numbers"
    if func._schema.is_mutable:
        return None, f"{name} writes a tensor in place"
    if name.startswith(("c10d::", "_c10d_functional::")):
        return None, f"{name} is a collective"
    try:
        sch = func._schema.arguments
        args = [(_up_dtype(a) if i < len(sch) and "ScalarType" in str(sch[i].type) else a)
                for i, a in enumerate(args)]
        kw = {k: (_up_dtype(v) if k in ("dtype", "out_dtype") else v) for k, v in (kwargs or {}).items()}
        with torch.no_grad():
            return func(*upcast(tuple(args)), **upcast(kw)), None
    except Exception as e:  # noqa: BLE001
        return None, _why(e)


def _sdpa_without_dropout(func, args, kwargs) -> bool:
    """An SDPA kernel is tagged as drawing random numbers for its dropout; with dropout_p 0 it
    draws none and is a function of its inputs."""
    if not func.overloadpacket.__name__.startswith("_scaled_dot_product_"):
        return False
    names = [a.name for a in func._schema.arguments]
    got = dict(zip(names, args))
    got.update(kwargs or {})
    return float(got.get("dropout_p") or 0.0) == 0.0


def _sdpa_oracle(func, args, kwargs) -> tuple[object | None, str | None]:
    """A fused SDPA backend (flash, memory-efficient, cuDNN) has no float64 kernel: its
    attention output (the op's output 0; the rest are its own softmax statistics) is the math
    backend's in float64, from the same arguments read by name."""
    names = [a.name for a in func._schema.arguments]
    got = dict(zip(names, args))
    got.update(kwargs)
    if float(got.get("dropout_p") or 0.0) > 0:
        return None, f"{_op_name(func)} draws random numbers (dropout)"
    mask = got.get("attn_bias", got.get("attn_mask"))
    try:
        q, k, v, mask = upcast((got["query"], got["key"], got["value"], mask))
        with torch.no_grad():
            out = torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, attn_mask=mask, is_causal=bool(got.get("is_causal") or False),
                scale=got.get("scale"))[0]
        return (out,), None
    except Exception as e:  # noqa: BLE001
        return None, _why(e)
