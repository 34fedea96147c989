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

The re-execution never changes what the probed model computes (`isolated`): state the dispatch
mode cannot see as a write is put back - an attribute or buffer the module assigns anew (a
RoPE cache rebuilt in float64), the Python state of the user's code (a counter in a global of
the model's file or in a dict the module holds: base/user_state.py), and the gradient-accumulation window the fixes' Functions add
their weight grads into (kernels/grad_carry.py; the oracle's backward would add its float64
grads to the step's carries, and so to the real .grad, and return none of its own).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpdiag.base.sparse import strided
from tpdiag.probes.float64_args import upcast
from tpdiag.probes.float64_isolated import isolated
from tpdiag.probes.float64_mode import DISCRETE, Float64Mode, OracleRefused, op_name, storage_ptr
# the buffers a forward writes, started from their values before it (probes/float64_state.py)
from tpdiag.probes.float64_state import _as_before, _up_dtype, _written_values, buffers_before  # noqa: F401
from tpdiag.probes.float64_taps import tapping as _tapping
from tpdiag.probes.value_shapes import ValueReads

_MAX_WHY = 300


def snapshot(x):
    """As upcast, but always a private copy: the module may later change its input in place."""
    from tpdiag.probes.float64_cache import is_cache, kept

    def one(t):
        if is_cache(t):  # a KV cache as it is before the call (probes/float64_cache.py)
            return kept(t)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return t.detach().to(_up_dtype(t.dtype), copy=True)
        if isinstance(t, torch.Tensor):
            return t.detach().clone()
        return t

    return tree_map(one, x)


def _why(e: BaseException) -> str:
    if isinstance(e, OracleRefused):
        return str(e)
    msg = " ".join(str(e).split())
    if len(msg) > _MAX_WHY:
        msg = msg[:_MAX_WHY] + "..."
    return f"its float64 re-execution raised {type(e).__name__}: {msg}"


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
    from tpdiag.probes.float64_cache import kept

    args, kwargs = kept((args, kwargs))  # its own copy of a KV cache among them: the call updates it
    protected = {storage_ptr(t) for t in list(mod.parameters()) + list(mod.buffers())}
    mode = Float64Mode(protected, working_dtype(mod))
    mine = {storage_ptr(b) for b in mod.buffers()}  # before _as_before swaps them for their copies
    try:
        with isolated(mod, buffers), torch.no_grad():
            swapped = _as_before(buffers)
            if names is not None:
                # a tensor attribute that is another module's buffer (`self.amax = observer.amax`) is
                # that buffer, read: never the call's own state
                mode.known = _own_storages(mod, (args, kwargs)) - (set(names["buffers"]) - mine)
            with ValueReads(mode.shaped), mode:
                out = mod(*args, **kwargs)
            mode.consumed(out)  # indices the module returns are a choice its caller reads
            written = _written_values(mod, swapped)
    except Exception as e:  # noqa: BLE001 - any failure is a reason, never a crash of the run
        return None, {"why": _why(e)}
    notes = {"discrete": mode.discrete} if mode.discrete else {}
    if mode.chosen:
        from tpdiag.records.hashing import tensor_hash

        notes["chosen"] = [tensor_hash(t) for t in mode.chosen]
    if mode.untold:
        notes["chosen_untold"] = list(mode.untold)
    if mode.shaped:
        notes["shaped"] = list(mode.shaped)
    # a Python number among its arguments may have been read from values by its caller (a token
    # count): its shapes are then not its inputs' alone (diff/shape_break.py)
    scalars = sum(1 for v in tree_flatten((args, kwargs))[0] if isinstance(v, (int, float)) and not isinstance(v, bool))
    if scalars:
        notes["scalar_args"] = scalars
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
    return {p for t in got if (p := storage_ptr(t)) > 0}


def state_names(model: torch.nn.Module) -> dict:
    """{"buffers": {storage ptr: path}, "params": {storage ptr: path}} of a model (module_oracle's
    names): a buffer read by a module that does not hold it is named by its path in the model."""
    bufs = {storage_ptr(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    params = {storage_ptr(p): n for n, p in model.named_parameters(remove_duplicate=False)}
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

    from tpdiag.probes.float64_cache import kept

    args, kwargs = kept((args, kwargs))  # as module_oracle
    own = {n: p for n, p in mod.named_parameters(recurse=False) if p.requires_grad}
    protected = {storage_ptr(t) for t in list(mod.parameters()) + list(mod.buffers())}
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
        with isolated(mod, buffers), torch.enable_grad(), _tapping(mod, taps, tapped):
            _as_before(buffers)
            with mode:
                out = functional_call(mod, {**frozen, **leaves}, args, kwargs, strict=False)
                mode.consumed(out)
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
    # nn.Embedding(sparse=True)'s weight grad is sparse here as in the real backward: its dense value,
    # as the real one is recorded (recorder.add)
    grads = {n: strided(t.detach()) for n, t in zip(names, got) if t is not None}
    return grads, ({"discrete": mode.discrete} if mode.discrete else {})


def op_oracle(func, args, kwargs) -> tuple[object | None, str | None]:
    """(one aten op's output in float64, None) or (None, why not); called from inside a dispatch
    mode's handler, so the op runs below every mode."""
    name = op_name(func)
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


def _sdpa_oracle(func, args, kwargs) -> tuple[object | None, str | None]:
    """A fused SDPA backend (flash, memory-efficient, cuDNN) has no float64 kernel: its
    attention output (the op's output 0; the rest are its own softmax statistics) is the math
    backend's in float64, from the same arguments read by name."""
    names = [a.name for a in func._schema.arguments]
    got = dict(zip(names, args))
    got.update(kwargs)
    if float(got.get("dropout_p") or 0.0) > 0:
        return None, f"{op_name(func)} draws random numbers (dropout)"
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
