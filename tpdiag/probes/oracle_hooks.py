"""The float64 oracle's hooks (probes/float64.py): a module's call re-executed in float64 from a
snapshot of its inputs, and its backward from the output grad it received, recorded as kind
"oracle" beside the real records. Both run with the recorder paused (`rec.in_oracle`): the module
probes neither record nor count the calls the re-execution makes."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tpdiag.probes.recorder import Recorder
from tpdiag.records.keys import ORACLE_NORMS, ORACLE_TAP, ROOT_MODULE as ROOT, ROOT_NAMESAKE, ROOTS, record_key

_NIDX = 16
_IDX = tuple(str(i) for i in range(_NIDX))


def _tensors(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


@contextmanager
def timed(rec: Recorder):
    """Adds the re-execution's wall time to rec.oracle_s (the world's `float64_s`). On a GPU the
    device is synchronised on both sides, so the float64 kernels count here and not in the work
    queued after them; a synchronisation changes no value."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    if sync:
        sync()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            sync()
        rec.oracle_s += time.perf_counter() - t0


# The name suffix of an oracle record that holds [||o||, ||y - o||] (float64) instead of o: the
# reference's own re-execution o of a module whose inputs differ at every other world of the pass,
# y the reference's real record. There the diff reads o for those two norms only
# (diff/oracle.judge_own), never whole (diff/oracle.apply judges a record against o only where
# the inputs were equal); writing o whole was ~2 GB of a llama-1b own-input reference at 1 x 2048.
NORMS = ORACLE_NORMS


def ref_norms(y, o: torch.Tensor) -> torch.Tensor:
    """[||o||, ||y - o||, o.o, o.y, y.y, sum o^4, numel] in float64: the first two as
    diff/oracle.judge_own computes them from the whole o (NaN for the second where y is no plain
    tensor of o's shape: judge_own then takes the floor), the rest the sums diff/scale.py fits one
    factor with (whether the reference is its float64 value times one factor: a user's grad hook
    rescaled it - diff/oracle_own.py); NaN where y is no plain tensor of o's shape."""
    o = o.detach().to(torch.float64)
    s = torch.linalg.vector_norm(o)
    nan = torch.full((), math.nan, dtype=torch.float64, device=o.device)
    if type(y) is torch.Tensor and tuple(y.shape) == tuple(o.shape) and y.is_floating_point():
        yy = y.detach().to(device=o.device, dtype=torch.float64)
        e = torch.linalg.vector_norm(yy - o)
        oo, oy, y2, o4 = s * s, (o * yy).sum(), (yy * yy).sum(), (o * o).square().sum()
    else:
        e = oo = oy = y2 = o4 = nan
    n = torch.full((), float(o.numel()), dtype=torch.float64, device=o.device)
    return torch.stack([s, e, oo, oy, y2, o4, n]).cpu()


def _norms_paused(rec: Recorder, y, o: torch.Tensor) -> torch.Tensor:
    """ref_norms with the recorder paused: its norms and subtraction are no ops of the step (an op
    probe recorded them into the reference's op stream, which the other world has not)."""
    with rec._paused():
        return ref_norms(y, o)


def _plain_like(y, o: torch.Tensor) -> bool:
    """y is the value the reference records, as it is here (a plain floating tensor of o's shape):
    its norms stand for the diff's. Anything else keeps o whole (the diff judges it as before)."""
    return type(y) is torch.Tensor and y.is_floating_point() and not o.is_complex() \
        and tuple(y.shape) == tuple(o.shape)


def inputs_differ(rec: Recorder, snap, name: str, call: int, own: dict) -> bool:
    """Whether, at EVERY other world of the pass (own: {label: its shipped inputs}, one entry per
    world: runner/drill_own.own_files), this call's floating inputs were shipped whole and at least
    one differs in bits from the reference's: the diff then finds this call's input records not
    bitwise (its own comparison of the same tensors), so it judges the module's records on their
    own inputs only - from the norms of the reference's re-execution. Only a one-rank reference,
    a step in one piece and no decode prefix, where the reference's record is the value here."""
    if not own or rec.world != 1 or rec.piece is not None or rec.prefix is not None:
        return False
    flat = [t for t in tree_flatten(snap)[0] if isinstance(t, torch.Tensor)]
    if any(t.is_complex() for t in flat):
        return False
    for tensors in own.values():
        differ = False
        for i, t in enumerate(flat):
            if not t.is_floating_point():
                continue
            got = tensors.get(record_key(rec.step, "forward", name, "in", call, i))
            if got is None or tuple(got.shape) != tuple(t.shape):
                return False
            differ = differ or not _same_bits(got, t)
        if not differ:
            return False
    return True


def _same_bits(shipped: torch.Tensor, here: torch.Tensor) -> bool:
    """Whether another world's shipped value and this one are bit for bit equal, compared as float64
    (an exact upcast of either: distinct bits stay distinct) on this one's device."""
    return torch.equal(shipped.to(device=here.device, dtype=torch.float64).view(torch.int64),
                       here.to(torch.float64).view(torch.int64))


def grad_out_differs(rec: Recorder, g, name: str, call: int, own: dict) -> bool:
    """Whether the output grad g this call received differs in bits from the one shipped for
    EVERY other world of the pass (as inputs_differ): the diff then finds the module's grad_out
    record not bitwise, so it judges its weight grads on their own inputs only."""
    if not own or rec.world != 1 or rec.piece is not None or rec.prefix is not None \
            or type(g) is not torch.Tensor or not g.is_floating_point():
        return False
    for tensors in own.values():
        got = tensors.get(record_key(rec.step, "backward", name, "grad_out", call, 0))
        if got is None or tuple(got.shape) != tuple(g.shape) or not got.is_floating_point():
            return False
        if _same_bits(got, g.detach()):
            return False
    return True


BUFFER = "buffer."  # an oracle record of a buffer the forward wrote: buffer.PATH (its path in the model)


def buffer_path(module_path: str, rel: str) -> str:
    """A buffer's path in the model from its path under the re-executed module: the oracle record
    names it so (relative to the module: HF's `model` child, named by its record name as the root
    was - both "model" before records/keys.ROOT_NAMESAKE - named its rotary_emb.inv_freq as the
    root's, no record of it: left unjudged without a word)."""
    return f"{module_path}.{rel}" if module_path else rel


def nearer_writer(full: str, module_path: str, oracle) -> bool:
    """A module between this one and the buffer's owner (the owner included) is re-executed too:
    its float64 run starts from what the owner really read, this one's from float64 values computed
    above it (diff/engine.py judges a buffer by its nearest writer)."""
    if not oracle:
        return False
    owner = full.rpartition(".")[0]
    parts = owner.split(".") if owner else []
    depth = len(module_path.split(".")) if module_path else 0
    return any(".".join(parts[:i]) in oracle for i in range(depth + 1, len(parts) + 1))


def record_oracle(rec: Recorder, mod: nn.Module, name: str, call: int, snap, style, cls, norms_of=None,
                  buffers=None, path: str | None = None, oracle=None, names=None) -> None:
    """Re-execute mod in float64 from its input snapshot; record each floating output (in the
    positions its real outputs have) or, when refused, why (rec.oracle_notes).
    norms_of: the module's real outputs, where only their norms against the re-execution are
    read (inputs_differ): each recorded as ref_norms(y, o) under NAME~norms. buffers: the module's
    buffers before its real forward (probes/float64.buffers_before), where it may have written them.
    path: the module's path in the model ("" for the root), oracle: the names re-executed.
    names: the model's state by storage (probes/float64.state_names): the buffers of other modules
    the call read are noted (notes["reads"]; diff/written_state.py)."""
    from tpdiag.probes.float64 import module_oracle

    rec.in_oracle, was = True, rec.enabled
    rec.enabled = False
    try:
        with timed(rec):
            out64, notes = module_oracle(mod, *snap, buffers=buffers, names=names)
    finally:
        rec.in_oracle, rec.enabled = False, was
    # the state its forward wrote, as the float64 run left it: judged against the buffer records
    # of the step (probes/model_walk.record_written_buffers; diff/oracle.target_key)
    for rel, t in (notes.pop("written", None) or {}).items():
        full = buffer_path(path if path is not None else ("" if name in ROOTS else name), rel)
        if not nearer_writer(full, path if path is not None else name, oracle):
            rec.add("oracle", name, f"{BUFFER}{full}", t, call=call, cls=cls)
    if notes:
        rec.oracle_notes[record_key(rec.step, "forward", name, "oracle", call)] = notes
    if out64 is None:
        return
    ys = _tensors(norms_of) if norms_of is not None else None
    for i, t in enumerate(_tensors(out64)):
        if t.is_floating_point() or t.is_complex():
            idx = _IDX[i] if i < _NIDX else str(i)
            y = ys[i] if ys is not None and i < len(ys) else None
            if _plain_like(y, t):
                rec.add("oracle", name, idx + NORMS, _norms_paused(rec, y, t), call=call, style=style, cls=cls)
            else:
                rec.add("oracle", name, idx, t, call=call, style=style, cls=cls)


TAP = ORACLE_TAP  # an oracle record of a child's output grad in its parent's float64 backward


def tap_name(short: str, parent_call: int, parent: str) -> tuple[str, str]:
    """(the descendant's record name, the oracle record's name) for module_oracle_grads'
    "tap:NAME:J:O" in the float64 backward of `parent` (its record name): `grad_out.O.cJ.pP.uK` - the
    descendant's O-th output at its J-th call inside the parent's call P, the parent K name levels up
    (the root's children are one level below it; diff/engine.py names the parent back from K). Two
    ancestors may tap one descendant (a stage's and the root's backward: diff/enclosing.judge): K
    keeps their records apart."""
    child, j, o = short[len("tap:"):].rsplit(":", 2)
    # the root: "(root)" above HF's `model` child, or "model" - where "model.x" is below the
    # tapper, that is HF's `model` child itself, whose children are one level below it
    root = parent == ROOT_NAMESAKE or parent == ROOT and not child.startswith(ROOT + ".")
    up = len(child.split(".")) - (0 if root else len(parent.split(".")))
    return child, f"{TAP}{o}.c{j}.p{parent_call}.u{up}"


def oracle_backward_hook(rec: Recorder, mod: nn.Module, name: str, call: int, snap, out,
                          handles: list, cls, pend: dict | None = None, on_grad=None, buffers=None,
                          taps: dict | None = None) -> None:
    """A module with one floating output that requires grad: when that output's grad arrives,
    the module's weight grads for this call are computed again in float64 from the same
    snapshot (probes/float64.py, module_oracle_grads) and recorded as oracle records
    `param_grad.SHORT.cCALL`, with its input grads as `grad_in.I.cCALL`. The hook returns None: the real grad is untouched.
    pend: {(step, module, short): [(call, cls, float64 grad)]} where only the norms of the weight grad
    against the real one are read (inputs_differ at some call): held for param_grad_norms, which
    records them when the real grad is accumulated, instead of the float64 grads; on_grad(g), called
    first, may add the module's entries there (module_probe: a one-call module whose output grad
    differs at every world)."""
    outs = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad and t.grad_fn is not None]
    if len(outs) != 1:
        return
    step = rec.step

    def hook(g):
        from tpdiag.probes.float64 import module_oracle_grads

        if on_grad is not None:
            with rec._paused():
                on_grad(g)

        rec.in_oracle, was = True, rec.enabled
        rec.enabled = False
        try:
            with timed(rec):
                grads, notes = module_oracle_grads(mod, *snap, g, buffers=buffers, taps=taps)
        finally:
            rec.in_oracle, rec.enabled = False, was
        if notes:
            rec.oracle_notes[record_key(step, "backward", name, "oracle", call)] = notes
        for short, t in (grads or {}).items():
            if short.startswith("tap:"):
                child, oname = tap_name(short, call, name)
                rec.add("oracle", child, oname, t, phase="backward")
                continue
            what = "grad_in" if short.startswith("in") and short[2:].isdigit() else "param_grad"
            short = short[2:] if what == "grad_in" else short
            if what == "param_grad" and pend is not None and (step, name, short) in pend:
                pend[(step, name, short)].append((call, cls, t))
                continue
            rec.add("oracle", name, f"{what}.{short}.c{call}", t, phase="backward", cls=cls)
        return None

    handles.append(outs[0].register_hook(hook))


def param_grad_norms(rec: Recorder, pend: dict, mname: str, short: str, g, cls) -> None:
    """The real weight grad g of (mname, short) was accumulated: its pending float64 grads, summed
    over the calls in the order the diff sums their records, recorded as ref_norms(g, sum) under
    `param_grad.SHORT~norms`. A one-piece step accumulates each grad once, after every call's
    backward; nothing pending (no call pended, or no float64 grad came): nothing recorded."""
    got = pend.pop((rec.step, mname, short), None)
    if not got:
        return
    o = got[0][2]
    for _, _, t in got[1:]:
        o = o + t
    if _plain_like(g, o):
        rec.add("oracle", mname, f"param_grad.{short}{NORMS}", _norms_paused(rec, g, o), phase="backward", cls=cls)
        return
    for call, c, t in got:  # not a value whose norms stand for the diff's: each call's whole, as before
        rec.add("oracle", mname, f"param_grad.{short}.c{call}", t, phase="backward", cls=c)


def _with_inputs(snap, key_of, tensors: dict):
    """The snapshot with each floating input replaced by another world's recorded value of it
    (float64), or None when one is missing or of another shape."""
    from torch.utils._pytree import tree_unflatten

    flat, spec = tree_flatten(snap)
    i, out = 0, []
    for t in flat:
        if isinstance(t, torch.Tensor):
            if t.is_floating_point() or t.is_complex():
                got = tensors.get(key_of(i))
                if got is None or tuple(got.shape) != tuple(t.shape):
                    return None
                t = got.to(device=t.device, dtype=t.dtype, copy=True)
            else:
                t = t.clone()
            i += 1
        out.append(t)
    return tree_unflatten(out, spec)


def record_own_oracles(rec: Recorder, mod: nn.Module, name: str, call: int, snap, own: dict,
                       style, cls, backward: bool, side_pend: dict | None = None, hooked=None,
                       buffers=None, taps: dict | None = None, path: str | None = None) -> None:
    """This (reference) module re-executed in float64 from each other world's own recorded
    inputs - its forward, and with its output grad there its backward - recorded as oracle
    records whose names end in `@LABEL` (diff/own_inputs.py says why).
    side_pend: where a weight grad's float64 value is held until the real grad is accumulated,
    to be kept as its norms against the other world's shipped record (probes/own_side_norms.py;
    hooked: {module: the parameter names whose accumulated grad the probe sees}).
    path: the module's path in the model ("" for the root): where the other world shipped its own
    parameters for this step (diff/own_params.py), it is re-executed from those (probes/own_params.py).
    Its notes - a refusal, discrete choices, the parameters it ran from - are kept per label
    (rec.oracle_notes_own): the diff says which module refused this side's re-execution, and why."""
    from tpdiag.probes import own_side_norms
    from tpdiag.probes.float64 import module_oracle, module_oracle_grads
    from tpdiag.probes.float64_cache import read_slots_empty
    from tpdiag.probes.own_params import shipped_for, swapped

    step = rec.step
    for label, tensors in own.items():
        got = _with_inputs(snap, lambda i: record_key(step, "forward", name, "in", call, i), tensors)
        if got is None:
            continue
        if not read_slots_empty(mod, got):
            # it would read the reference's cached keys and values, which no record of this side
            # holds: no exact value of this side's (probes/float64_cache.py)
            rec.oracle_notes_own.setdefault(label, {})[record_key(step, "forward", name, "oracle", call)] = {
                "why": "it reads a KV cache's earlier entries, which this side's records do not hold"}
            continue
        rec.in_oracle, was = True, rec.enabled
        rec.enabled = False
        try:
            # counted in float64_s with the other re-executions (it was not: in the own-input
            # pass's reference these are most of that world's float64 work)
            params = shipped_for(mod, path, step, tensors) if path is not None else None
            with timed(rec), swapped(params):
                out64, notes = module_oracle(mod, *got, buffers=buffers)
                grads, g_notes = None, {}
                g = tensors.get(record_key(step, "backward", name, "grad_out", call, 0))
                if backward and g is not None:
                    # on the device the module's inputs are (the file was read to the host)
                    g = g.to(next((t.device for t in _tensors(got)), g.device))
                    again = _with_inputs(snap, lambda i: record_key(step, "forward", name, "in", call, i), tensors)
                    grads, g_notes = module_oracle_grads(mod, *again, g, buffers=buffers, taps=taps)
        finally:
            rec.in_oracle, rec.enabled = False, was
        notes = {k: v for k, v in (notes or {}).items() if k != "written"}  # tensors, never a note
        if params:
            notes["params"] = "this side's"
        mine = rec.oracle_notes_own.setdefault(label, {})
        for phase, n in (("forward", notes), ("backward", g_notes or {})):
            if n:
                mine[record_key(step, phase, name, "oracle", call)] = n
        for i, t in enumerate(_tensors(out64) if out64 is not None else ()):
            if t.is_floating_point() or t.is_complex():
                rec.add("oracle", name, f"{_IDX[i] if i < _NIDX else i}@{label}", t, call=call,
                        style=style, cls=cls)
        for short, t in (grads or {}).items():
            if short.startswith("tap:"):
                child, oname = tap_name(short, call, name)
                rec.add("oracle", child, f"{oname}@{label}", t, phase="backward")
                continue
            what = "grad_in" if short.startswith("in") and short[2:].isdigit() else "param_grad"
            short = short[2:] if what == "grad_in" else short
            y = own_side_norms.wanted(rec, tensors, step, name, short, t, hooked) \
                if what == "param_grad" and side_pend is not None else None
            if y is not None:
                own_side_norms.hold(side_pend, rec, label, name, short, call, cls, t, y)
                continue
            rec.add("oracle", name, f"{what}.{short}.c{call}@{label}", t, phase="backward", cls=cls)
