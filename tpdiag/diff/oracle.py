"""Bug or rounding, for any module or op: the verdict from a float64 re-execution (an oracle).

The reference world of a second pass re-executes the first divergent module (its own forward)
and the ops it records in float64, from the reference's own inputs and parameters
(probes/float64.py). Here, for a record whose inputs were bitwise equal at both sides (so the
oracle's value is the exact answer for BOTH), with o the float64 value:

    e_ref = ||y_ref - o||,   e_N = ||y_N - o||,   s = ||o||          (2-norms, float64)
    level = max(e_ref, u s)      u: the unit roundoff of the record's dtype (fp32 2**-24, bf16 2**-8)
    far   <=>  e_N > A(n) level, A(n) = 8 for n >= 16 outputs, 8 * 16 / n below (margin())

far is a wrong result (`sharding-bug`); near is rounding (the reordering cause named by the
record's layout or by the ops inside it). Backward records are judged the same way against the
module's backward run again in float64 from the output grad it received (probes/float64.py,
module_oracle_grads): a weight grad of the module, and the grad_out of the module that produced
its one input (that input's grad), when everything the module saw - inputs, parameters, output
grad - was bitwise equal.

Why a pure reordering is never called far. A reordering evaluates the same function of the same
inputs, only summing, blocking or splitting differently; its error against the exact value is a
sum of the same per-operation roundings (each at most u times an intermediate the two sides
share) that make the reference's own error e_ref, which is measured here for this very module,
data and dtype - its conditioning (cancellation, a softmax's exp, a norm's 1/sigma) included.
What a reordering may add is a handful of roundings per output (TP=N rounds up to N partial
sums, Higham's gamma_K grows with the blocking), which over many outputs moves the 2-norm by a
small factor, inside A; and no side can be closer than rounding its result once (u s),
hence the floor.
A 2-norm over n outputs is an average of n rounding errors; for a handful of outputs the two
sides' errors are few independent draws, so A grows as 16/n below 16 outputs; over many
outputs they concentrate, so A narrows towards 3 (benchmarks/jobs/oracle_threshold.py measures
the smallest planted error still called a bug, per dtype and size). Measured on CPU
(tests/test_oracle.py; 5 seeds, K = 64..4096, N = 2, 4, 8, every partial rounded to the output
dtype): split-K matmuls summed in several orders, distributed LayerNorm statistics and softmaxes
of reordered logits reach e_N/level <= 1.10 in fp32 and <= 1.32 in bf16; planted mistakes reach
>= 6e4 in fp32 and, in bf16, 17 (a LayerNorm over half the width), 355 (a reversed gather) and
4.7 (a bias of 0.02 added twice: under A, so not called a bug - in bf16 a mistake that small is
inside what one rounding of the output can move). The hand-written layers of
tests/models/planted land 1e4-1e6 beyond in fp32, their correct twins at e_N/level of about 1.
Discrete choices: when the re-execution made a discrete choice on floating values (top-k,
argmax, a comparison: probes/float64_mode.DISCRETE), a rounding difference upstream of it inside the
module can flip it and move the output by O(1); a far result is then not called a bug (the
cause stays `unknown`, saying so).
"""
from __future__ import annotations

import math

import torch

from tpdiag.diff.op_inputs import after_uncompared_op, op_window  # noqa: F401 (op_window read from here)
from tpdiag.diff.bits import UNIT_ROUNDOFF
from tpdiag.diff.equal_inputs import grads_equal, inputs_equal, params_equal  # noqa: F401 (read from here too)
from tpdiag.records.keys import RecordKey, record_key, sole_consumer
from tpdiag.records.layout import first_positions

MARGIN = 8.0
SMALL = 16  # outputs below this many elements widen the margin as 16/n
# Above 16 outputs the margin stays 8. A margin narrowing as 3 + 5 sqrt(16/n) was tried: it called
# a correct MLA model's replicated weight grad a bug (dots3 at TP=2, kv_a_proj_with_mqa: the two
# ranks' partial grads summed, e_N / e_ref = 3.86 at n = 2560 against A = 3.40) - a reordering can
# reach several times the reference's own error where few roundings dominate, so 8 it is.
MARGIN_LARGE = MARGIN


def margin(n: int) -> float:
    """A for a record of n elements: the 2-norm of n rounding errors concentrates as n grows
    (its relative spread ~ 1/sqrt(2n)), so the factor a reordering can reach over the
    reference's own error shrinks from 8 at 16 outputs towards MARGIN_LARGE; below 16 outputs
    the two sides' errors are few independent draws and it widens as 16/n."""
    if n < SMALL:
        return MARGIN * SMALL / n
    return MARGIN_LARGE + (MARGIN - MARGIN_LARGE) * math.sqrt(SMALL / n)


def target_key(oracle_key: str) -> str:
    """s0/forward/m/oracle#1/0 -> s0/forward/m/out#1/0 (a module's output);
    s0/forward/m/oracle#0/aten::mm#2.0 -> s0/forward/m/op#0/aten::mm#2.0 (an op's)."""
    k = RecordKey.parse(oracle_key)
    if k.name.startswith("buffer."):
        # s0/forward/m/oracle#0/buffer.m.sub.amax -> s0/optimizer/m.sub/buffer#0/amax (the state the
        # forward wrote, recorded after the step: probes/model_walk.record_written_buffers; its path
        # in the model, probes/oracle_hooks.buffer_path)
        owner, _, short = k.name[len("buffer."):].rpartition(".")
        # no owner: the root's own buffer, which only the root's own re-execution writes - recorded
        # under the root's record name, this oracle record's module ("(root)" above HF's `model`)
        return record_key(k.step, "optimizer", owner or k.module, "buffer", 0, short)
    if k.name.startswith("param_grad."):
        # s0/backward/m/oracle#0/param_grad.weight.c1 -> s0/backward/m/param_grad#0/weight (the
        # calls' float64 grads are summed, as the real grad accumulates)
        short = k.name[len("param_grad."):].rsplit(".c", 1)[0]
        return record_key(k.step, k.phase, k.module, "param_grad", 0, short)
    return record_key(k.step, k.phase, k.module, "op" if "::" in k.name else "out", k.call, k.name)


def judge(y_ref: torch.Tensor, y_n: torch.Tensor, o: torch.Tensor, partials: float = 0.0) -> dict | None:
    """The verdict for one record (see the module doc), or None when it cannot be formed
    (shapes differ, non-finite values: those are findings of their own). Its float64 norms on the
    parent's check device where it has one (diff/on_device.py). partials: sqrt(sum_r ||p_r||^2)
    of the rank partials this side rounded and summed (diff/rank_partials.py), 0 where none."""
    from tpdiag.diff import on_device

    return on_device.run(_judge, y_ref, y_n, o, partials)


def _judge(y_ref: torch.Tensor, y_n: torch.Tensor, o: torch.Tensor, partials: float = 0.0) -> dict | None:
    if y_ref.shape != y_n.shape or tuple(o.shape) != tuple(y_ref.shape):
        return None
    if not (y_ref.is_floating_point() or y_ref.is_complex()):
        return None
    cd = torch.complex128 if o.is_complex() or y_ref.is_complex() else torch.float64
    a, b, r = (t.to(cd) for t in (y_ref, y_n, o))
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
            and bool(torch.isfinite(r).all())):
        return None
    n = max(1, a.numel())
    e_ref = float(torch.linalg.vector_norm(a - r))
    e_n = float(torch.linalg.vector_norm(b - r))
    s = float(torch.linalg.vector_norm(r))
    return _verdict(e_ref, e_n, s, n, UNIT_ROUNDOFF.get(y_ref.dtype, UNIT_ROUNDOFF[torch.float32]), partials)


def _verdict(e_ref: float, e_n: float, s: float, n: int, u: float, partials: float = 0.0) -> dict:
    """judge()'s verdict from its norms (module doc); partials: judge()'s."""
    # rounding each rank's partial once is a rounding the reference never made: where the
    # partials cancel it dwarfs e_ref and u s (diff/rank_partials.py)
    level = max(e_ref, u * s, u * partials)
    margin_ = margin(n)
    thr = margin_ * level
    ratio = e_n / thr if thr > 0 else (0.0 if e_n == 0 else math.inf)
    rel = (lambda e: e / s) if s > 0 else (lambda e: e)
    return {"far": e_n > thr, "ratio": ratio, "ref_err": rel(e_ref), "err": rel(e_n),
            "floor": u if s > 0 else 0.0, "margin": margin_, "threshold": rel(thr),
            "relative": s > 0, "n": n}


def judge_own(y_ref: torch.Tensor, y_n: torch.Tensor, o_ref: torch.Tensor | None, o_n: torch.Tensor,
              ref_norms: torch.Tensor | None = None, partials: float = 0.0) -> dict | None:
    """_judge_own on the parent's check device where it has one (diff/on_device.py)."""
    from tpdiag.diff import on_device

    return on_device.run(_judge_own, y_ref, y_n, o_ref, o_n, ref_norms, partials)


def _judge_own(y_ref: torch.Tensor, y_n: torch.Tensor, o_ref: torch.Tensor | None, o_n: torch.Tensor,
               ref_norms: torch.Tensor | None = None, partials: float = 0.0) -> dict | None:
    """A record past the first divergence, judged on its own inputs: o_n is the reference's
    module re-executed in float64 from THIS side's inputs (diff/own_inputs.py), o_ref from the
    reference's. Each side's relative distance from its own exact value; this side far when
        e_N / ||o_N|| > A * max(e_ref / ||o_ref||, u)
    - the reference's own error on its own inputs measures this computation's rounding (its
    conditioning included), as in judge(); without o_ref only the one-rounding floor u.
    ref_norms: [||o_ref||, ||y_ref - o_ref||] where the reference's world kept those instead of
    o_ref (probes/oracle_hooks.NORMS; NaN in the second where the shapes differed there)."""
    got = _judge(y_n, y_n, o_n)
    if got is None:
        return None
    cd = torch.complex128 if o_n.is_complex() or y_n.is_complex() else torch.float64
    s_n = float(torch.linalg.vector_norm(o_n.to(cd)))
    e_n = float(torch.linalg.vector_norm(y_n.to(cd) - o_n.to(cd)))
    return _own_verdict(got, y_ref, y_n, o_ref, ref_norms, s_n, e_n, cd, partials)


def _own_verdict(got: dict, y_ref, y_n, o_ref, ref_norms, s_n: float, e_n: float, cd, partials: float = 0.0) -> dict:
    """_judge_own's verdict from this side's norms (got: _judge(y_n, y_n, o_n)'s); partials:
    this side's rank partials' norm (judge()'s)."""
    u = UNIT_ROUNDOFF.get(y_ref.dtype, UNIT_ROUNDOFF[torch.float32])
    ref_rel = 0.0
    if o_ref is not None and tuple(o_ref.shape) == tuple(y_ref.shape) and y_ref.shape == y_n.shape:
        s_r = float(torch.linalg.vector_norm(o_ref.to(cd)))
        e_r = float(torch.linalg.vector_norm(y_ref.to(cd) - o_ref.to(cd)))
        if math.isfinite(e_r):
            ref_rel = e_r / s_r if s_r > 0 else e_r
    elif o_ref is None and ref_norms is not None and y_ref.shape == y_n.shape:
        s_r, e_r = (float(x) for x in ref_norms.to(torch.float64).reshape(-1)[:2])
        if math.isfinite(e_r):
            ref_rel = e_r / s_r if s_r > 0 else e_r
    if s_n == 0:
        return {**got, "own": True}
    level = max(ref_rel, u, u * partials / s_n)
    err = e_n / s_n
    thr = got["margin"] * level
    return {"far": err > thr, "ratio": err / thr, "ref_err": ref_rel, "err": err, "floor": u,
            "margin": got["margin"], "threshold": thr, "relative": True, "n": got["n"], "own": True}


def notes_for(dd, row: dict) -> dict:
    """What the reference world noted about this record's re-execution (refusal, discrete ops)."""
    notes = getattr(dd, "oracle_notes", None) or {}
    if row["kind"] in ("param_grad", "grad_out"):
        # a grad_out is judged by its consumer's backward: that module's choices, not its producer's
        # (an MoE's argmax behind the norm whose grad it returns: a flip read as a bug in bf16)
        m = row["module"] if row["kind"] == "param_grad" else sole_consumer(row.get("consumers"))
        want = (int(row["step"]), "backward", m, "oracle")
        return next((v for k, v in notes.items() if _of_call(RecordKey.parse(k)) == want), {})
    if row["kind"] == "buffer":
        # what the step left in a buffer is its writer's every call's doing: each call's choices
        # (a choice made at the second call only was not read, and a flip was called a bug)
        want = (int(row["step"]), "forward", writer_of(dd, row), "oracle")
        # the notes of its calls (name None), not of its ops' own re-executions
        got = [v for k, v in notes.items() if _of_call(p := RecordKey.parse(k)) == want and p.name is None]
        merged = {k: v for n in got for k, v in n.items() if k != "discrete"}
        discrete = list(dict.fromkeys(d for n in got for d in n.get("discrete") or ()))
        return {**merged, **({"discrete": discrete} if discrete else {})}
    if row["kind"] == "op":
        return notes.get(record_key(row["step"], row["phase"], row["module"], "oracle", row.get("call") or 0,
                                    row["name"].rsplit(".", 1)[0]), {})
    return notes.get(record_key(row["step"], "forward", row["module"], "oracle", row["call"]), {})


def writer_of(dd, row: dict) -> str:
    """The module whose float64 re-execution holds a buffer record's oracle value (diff/engine.py
    picks the nearest re-executed one, the buffer's owner where that was re-executed): its inputs
    must be equal and its choices are the ones that count."""
    got = (getattr(dd, "oracle_writer", None) or {}).get(row["key"])
    return got[1] if got else row["module"]


def _of_call(k: RecordKey) -> tuple:
    return k.step, k.phase, k.module, k.kind


def forward_equal(dd, module: str, step: int) -> bool:
    """Every call of the module's forward in that step saw bitwise-equal inputs and parameters
    (and the step before left its buffers equal): the state it wrote has one exact value for both
    sides, its float64 re-execution's."""
    calls = _index_calls(dd).get((step, module))
    return bool(calls) and all(inputs_equal(dd, {"module": module, "step": step, "call": c}) for c in calls)


def _index_calls(dd) -> dict:
    from tpdiag.diff.equal_inputs import _index

    return _index(dd)["calls"]


def verdict_for(dd, row: dict) -> dict | None:
    """judge() on this record against its oracle, with the reference world's notes; None when
    there is no oracle value for it."""
    from tpdiag.diff import rank_partials

    o = (getattr(dd, "oracle", None) or {}).get(row["key"])
    pair = dd.tensors.get(row["key"])
    if o is None or pair is None:
        return None
    got = judge(pair[0], pair[1], first_positions(o, pair[1], row.get("positions")),
                rank_partials.partials_in(dd, row))
    if got is None:
        return None
    discrete = notes_for(dd, row).get("discrete")
    if discrete and no_reference(got):
        mark_no_reference(got, discrete)
    elif discrete and _choices_equal(dd, row, discrete):
        # no flipped tie: the op-level pass recorded every such choice, bitwise equal on both sides
        got["choices_equal"] = list(discrete)
    elif discrete:
        got["discrete"] = list(discrete)
    return got


def no_reference(v: dict) -> bool:
    """A module with discrete choices whose reference is itself more than MARGIN roundings from the
    float64 re-execution: the float64 run chose otherwise (a bf16 router's near tie), so its value
    is no reference for either side and a threshold scaled by the reference's distance judges
    nothing (a bf16 capacity-dropping MoE read "near" at 0.33 against an "allowed" 1.32)."""
    return v.get("floor", 0) > 0 and v["ref_err"] > v["margin"] * v["floor"]


def mark_no_reference(v: dict, discrete) -> None:
    # read as far with a choice that may have flipped: never near (a reordering), never a bug
    v["far"], v["discrete"], v["no_reference"] = True, list(discrete), True


def _choices_equal(dd, row: dict, discrete) -> bool:
    """Whether each discrete op of this module's call (argmax, top-k, a comparison on floating
    values: probes/float64_mode.DISCRETE) has op records here (probes/op_probe.py records their
    outputs) and every one is bitwise equal on both sides. A grad_out's choices are its one
    consumer's (notes_for reads them there), so its ops are looked for there too."""
    from tpdiag.records.keys import sole_consumer

    m = (sole_consumer(row.get("consumers")) if row.get("kind") == "grad_out" else None) or row["module"]
    for d in discrete:
        got = [r for r in dd.rows if r["kind"] == "op" and r["step"] == row["step"] and r["phase"] == "forward"
               and (r["module"] == m or r["module"].startswith(m + ".")) and r["name"].startswith(d + "#")]
        if not got or not all(r["bitwise"] and r.get("rank_consistent") is not False for r in got):
            return False
    return True


def describe(v: dict) -> str:
    """One line: how far each side is from the float64 value."""
    unit = "relative " if v.get("relative") else ""
    return (f"float64 re-execution: the reference is {v['ref_err']:.2e} from it, this side "
            f"{v['err']:.2e} ({unit}2-norm; threshold {v['threshold']:.2e} = {v['margin']:g} x "
            f"max(reference, one rounding))")


def _grad_in_oracle(dd, row: dict):
    """A grad_out record of X whose one consumer C took X's output as its one floating input in
    one call: C's float64 input grad is the exact value for both sides, if everything C saw
    (its inputs, parameters and output grad) was equal."""
    c = sole_consumer(row.get("consumers"))
    if c is None:
        return None
    got = [(k, v) for k, v in dd.grad_in.items() if k[0] == row["step"] and k[1] == c]
    if len(got) != 1 or len(got[0][1]) != 1:
        return None
    probe = {"module": c, "step": row["step"], "idx": row["idx"], "kind": "param_grad", "call": 0}
    if not grads_equal(dd, probe):
        return None
    return got[0][1][0]


def _note_refusals(dd) -> None:
    """A divergent forward output or weight grad whose float64 re-execution the reference refused
    (a random draw, an in-place write of state): the reason is evidence for an `unknown` verdict -
    without it the verdict read "no rounding model fits", as if the module computed something else."""
    if not getattr(dd, "oracle_notes", None):
        return
    for row in dd.rows:
        if (row["bitwise"] and row.get("rank_consistent") is not False) or row["key"] in (getattr(dd, "oracle", None) or {}):
            continue
        if (row["phase"], row["kind"]) in (("forward", "out"), ("backward", "param_grad")):
            why = notes_for(dd, row).get("why")
            if why:
                row["oracle_refused"] = why
        elif row["kind"] == "buffer" and row.get("rank_consistent") is not False:
            # state the step wrote that no float64 run left a value for: said, never left silently
            row["oracle_refused"] = notes_for(dd, row).get("why") or (
                f"no float64 re-execution in this pass left a value for it ({row['module']}'s forward, or "
                "the code that wrote it, was not re-executed)")


def apply(dd) -> None:
    """Judge every divergent forward output and op whose inputs were equal and which has an
    oracle value. Sets row['oracle'] and, when far, beyond_bound (a bug); when near, leaves the
    rounding cause to the layout or the ops."""
    from tpdiag.diff import other_paths

    for row in dd.rows:
        if row["phase"] == "backward" and row["kind"] == "grad_out" and not row["bitwise"] \
                and getattr(dd, "grad_in", None) and row["key"] in dd.tensors:
            o = _grad_in_oracle(dd, row)
            if o is not None:
                other_paths.attach(dd, row, o)
    _note_refusals(dd)
    if not getattr(dd, "oracle", None):
        return
    from tpdiag.diff import written_state

    wrong = written_state.wrong_buffers(dd, forward_equal, verdict_for, writer_of)
    first_seen = False
    for row in dd.rows:
        if row["bitwise"] and row.get("rank_consistent") is not False:
            continue
        first, first_seen = not first_seen, True
        if row["kind"] in ("out", "op"):
            why = written_state.read_after(dd, row, wrong)
            if why:
                row["oracle_refused"] = row["reads_written"] = why
                continue
        if not ((row["phase"] == "forward" and row["kind"] in ("out", "op"))
                or (row["phase"] == "backward" and row["kind"] in ("param_grad", "grad_out"))
                or row["kind"] == "buffer"):
            continue
        if row["key"] not in dd.oracle and row["key"] in getattr(dd, "oracle_norms", {}) \
                and not row.get("nonfinite_mismatch") and row["kind"] in ("out", "param_grad") \
                and (inputs_equal(dd, row) if row["kind"] == "out" else grads_equal(dd, row)):
            # the reference's world kept only the norms of its float64 value, having seen this
            # record's inputs differ (probes/oracle_hooks.inputs_differ): read equal here, they
            # contradict it - no verdict from a value that is not there (fail closed: unknown)
            row["oracle_refused"] = ("the reference world kept only the norms of its float64 re-execution "
                                     "(its inputs differed there), which judge no record of equal inputs")
            continue
        if row["key"] not in dd.oracle or row.get("nonfinite_mismatch") or row["bitwise"]:
            continue
        # an op's inputs are the ops before it: equal only for the run's first divergent record,
        # and only when no op before it in its module had no reference value to compare
        if row["kind"] == "op" and (not first or after_uncompared_op(dd, row)):
            continue
        if row["kind"] == "out" and not inputs_equal(dd, row):
            continue
        if row["kind"] == "param_grad" and not grads_equal(dd, row):
            continue
        if row["kind"] == "buffer" and not forward_equal(dd, writer_of(dd, row), row["step"]):
            continue
        v = verdict_for(dd, row)
        if v is None:
            continue
        if row["kind"] == "buffer" and writer_of(dd, row) != row["module"]:
            # judged by another module's float64 run (the nearest re-executed writer): named, so the
            # gate can find that evidence (diff/oracle_evidence.py)
            v = {**v, "module": writer_of(dd, row)}
        row["oracle"] = v
        if v["far"] and v.get("discrete"):
            from tpdiag.diff import flip_unjudged

            if flip_unjudged.shows_nothing(row, v):
                flip_unjudged.leave_unjudged(row, v, v["discrete"])
                continue
            row["cause_why"] = (f"{describe(v)}: the reference itself is more than {v['margin']:g} roundings from "
                                f"it - the float64 run chose otherwise at its discrete choices "
                                f"({', '.join(v['discrete'])}) - so it is no reference: neither rounding nor a "
                                "bug is shown" if v.get("no_reference") else
                                f"{describe(v)}: far from it, but it makes a discrete choice on "
                                f"floating values ({', '.join(v['discrete'])}) that a rounding "
                                "difference inside it can flip, so it is not called a bug")
            row["oracle_flip"] = True
            continue
        what = "float64 re-execution of the " + {"op": "op", "param_grad": "module's backward",
                                                 "grad_out": "consumer's backward",
                                                 "buffer": "forward that wrote it"}.get(row["kind"], "module")
        if row.get("other_path"):
            what += other_paths.what(dd, row["other_path"])
            v["what"] = "its consumer's backward" + other_paths.what(dd, row["other_path"])
        if row.get("bound") is None:
            row["bound_ratio"] = v["ratio"]
            row["beyond_bound"] = v["far"]
            row["bound_model"] = what
            if v["far"]:
                row.pop("generic_cause", None)
        else:
            # a rigorous bound (a layout's, or a fitted model's) may sharpen the verdict, never
            # overrule a far oracle
            if v["far"]:
                row["beyond_bound"] = True
                row["bound_ratio"] = max(row.get("bound_ratio") or 0.0, v["ratio"])
            row["bound_model"] = f"{row['bound_model']}; {what}" if row.get("bound_model") else what
