"""Bug or rounding, for any module or op: the float64 re-executions (oracles) matched to the records
they judge, and each record's verdict with the reference world's notes (refusals, discrete choices).
The verdict's arithmetic - far or near, its margin and why a reordering is never called far - is
diff/oracle_verdict.py's (judge, judge_own, margin: read from here too)."""
from __future__ import annotations

from tpdiag.diff.op_inputs import after_uncompared_op, op_window  # noqa: F401 (op_window read from here)
from tpdiag.diff.equal_inputs import grads_equal, inputs_equal, params_equal  # noqa: F401 (read from here too)
from tpdiag.diff.oracle_verdict import (MARGIN, MARGIN_LARGE, SMALL, _own_verdict, _verdict,  # noqa: F401 (read from here too)
                                        judge, judge_own, margin)
from tpdiag.records.keys import RecordKey, record_key, sole_consumer
from tpdiag.records.layout import first_positions


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
