"""What the cause judge reads: Evidence (what is known of one record), the Verdict it gives, the
Rule it is made of, and the predicates and reasons diff/judge.py's RULES are written in.

Nothing here names a cause for a record: RULES (judge.py) is the one ordered list that does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tpdiag.records.causes import cause_class
from tpdiag.diff.reasons import WHY_ATTENTION, WHY_DECODE, WHY_MICRO_BATCH, WHY_ROWS
from tpdiag.records.ops import COLLECTIVE_OPS, is_op_of


@dataclass(frozen=True)
class Evidence:
    """What is known about one record. `row` is its diff row (bits, bounds, float64 verdicts,
    layout: engine.py, locate.add_bounds, oracle.py); None for a record read back from a
    summary, whose recorded verdict then stands for everything the row would have said.
    `record` is the described record itself (the first divergence or a finding): its bound and
    float64 verdicts as the summary holds them, and the first divergence's op."""
    row: dict | None
    record: dict
    op: str | None = None          # the first divergent op, as the first pass located it
    op_oracle: dict | None = None  # the first divergent op's float64 verdict, where it judges the record
    flip: str | None = None        # a router-flip record: "consequence" (a divergence before it) or "root"
    after_flip: str | None = None  # the key of a real router flip earlier in the same degree
    flip_untold: str | None = None  # after it, beyond the bound on rows not the flipped ones, sequences not told (why)
    broken_tie: bool = False       # a weight grad of a tie the plan split (models/ties.py)
    short_of_whole: str | None = None  # the first record the ranks hold only part of (why: diff/shape_break.py)
    short_after: str | None = None  # the record before it that differed already, if any (diff/shape_break.py)
    dropped_hook: str | None = None  # a weight grad whose user hook the plan dropped (why: diff/dropped_hooks.py)
    optimizer_step: tuple | None = None  # (cause, why): a capture's own optimizer step judged link by link (diff/optim_step.py)
    not_reference: str | None = None  # a per-rank block whose weights are none of the reference's (why)
    tp1_both: bool = False         # both worlds at TP=1: nothing is sharded
    axis: str = "tp"               # what the configuration differs from the reference in
    noise: int | None = None       # a rerun at the reference's degree (this degree): run-to-run noise
    noise_always: bool = False     # the reference's own rerun: even NaN/Inf there is noise
    # what the reruns found (runner/drill.py, runner/confirm.py)
    second: tuple | None = None    # (cause, why) the second pass judged this first divergence with
    op_pass: tuple | None = None   # (op, cause) the op-level rerun named at this first divergence
    own_near: str | None = None    # re-executed on its own inputs: within rounding; the first divergence's cause
    confirmed: dict | None = None  # a confirmed fix: {"fix", "cause" (the confirmed one), "bitwise" (this record after it)}
    source_equal: bool | None = None  # the first divergent op is a pick: its source bitwise equal (diff/locate.py)
    caller_oracle: dict | None = None  # an input that differs: its caller's output against its float64 re-execution


@dataclass(frozen=True)
class Verdict:
    cause: str
    why: str | None = None
    rule: str = ""
    # the cause a rule overrode, under the name the summary keeps it by (layout_cause, cause_before)
    kept: dict = field(default_factory=dict)
    # the structured name the summary keeps for the verdicts others read (`rule`: records/share_rules.py)
    tag: str | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    when: Callable[[Evidence, Callable[[], Verdict]], bool]
    cause: Callable[[Evidence, Callable[[], Verdict]], str]
    why: Callable[[Evidence, Callable[[], Verdict]], str | None] = lambda ev, below: None
    keep: str | None = None  # record the overridden cause under this key
    # the verdict's structured name in the summary (`rule`), where a later pass or the gate reads it
    tag: Callable[[Evidence, Callable[[], Verdict]], str | None] = lambda ev, below: None


# ---- evidence predicates -------------------------------------------------------------------

def _row(ev: Evidence, key: str):
    return (ev.row or {}).get(key)


def judged_far(f: dict) -> bool:
    """A float64 re-execution (from the record's own inputs or equal ones) found it wrong."""
    return any((f.get(k) or {}).get("far") and not (f.get(k) or {}).get("discrete")
               for k in ("oracle", "op_oracle"))


def judged_near(f: dict) -> bool:
    """A float64 re-execution of the record ran and found it within rounding. A record no
    re-execution judged stays what its bound says (fail closed: an unjudged downstream bug is
    never cleared by the confirmation of an upstream rounding)."""
    verdicts = [f.get(k) for k in ("oracle", "op_oracle") if isinstance(f.get(k), dict) and "far" in f.get(k)]
    # far with a discrete choice inside is not judged far (a flip is not shown to be a bug), and
    # not near either: it shows no rounding
    return bool(verdicts) and not any(v.get("far") for v in verdicts)


def why_at_op(op: str, axis: str = "tp") -> str:
    """Why a first divergence located at an op is still `unknown` (the module pass's words said no
    op was recorded; the op-level pass found one)."""
    from tpdiag.records.ops import RANDOM_OPS

    if is_op_of(op, RANDOM_OPS) and axis in ("micro_batch", "mode"):
        # the draw follows the calls, not a layout: a draw left on at inference is the user's to see
        calls = "micro-batches" if axis == "micro_batch" else "decode's one position per call"
        return (f"the difference enters at {op}, a random draw: the tokens go through it in other calls "
                f"({calls}), so they draw other numbers and the configurations compute different "
                "functions. Left on at inference (dropout with training=True, noise) it makes an "
                "engine's logprobs random; turn it off (eval mode, p=0) to compare; neither rounding nor "
                "a proven bug")
    if is_op_of(op, RANDOM_OPS):
        return (f"the difference enters at {op}, a random draw: dropout or noise in the sharded region "
                "draws other numbers at each layout, so the degrees compute different functions - turn "
                "it off (eval mode, p=0) to compare; neither rounding nor a proven bug")
    return f"the difference enters at {op} (the op-level pass), and no rule judged it"


def _no_op_recorded(v: Verdict) -> bool:
    return v.cause == "unknown" and str(v.why or "").endswith("no op there was recorded")


def _op_pass_why(ev: Evidence, below) -> str | None:
    return why_at_op(ev.op_pass[0], ev.axis) if _no_op_recorded(below()) else below().why


# why an attention kernel's output differs on bitwise-equal inputs, by what the configuration changed
_WHY_ATTENTION_OP = {
    "mode": WHY_DECODE, "micro_batch": WHY_MICRO_BATCH, "attention": WHY_ATTENTION,
    "tp": ("its inputs were bitwise equal (each rank's own heads) and its output is not: the kernel ran on "
           "another call shape (fewer heads per call at TP > 1) and summed in another order"),
}


def _attention_op_why(ev: Evidence, below) -> str | None:
    """The module pass's reason, unless it said no op was recorded: the op-level pass has since named
    the attention op, so that reason would contradict the op the record names."""
    v = below()
    if not _no_op_recorded(v):
        return v.why
    why = _WHY_ATTENTION_OP.get(ev.axis, _WHY_ATTENTION_OP["tp"])
    return f"the difference enters at {ev.op}, an attention kernel: {why}"


def far_flip_unshown(ev: Evidence, below) -> bool:
    """A record past the first divergence far from its float64 re-execution, with a discrete choice
    inside that may have flipped (diff/oracle.py oracle_flip) and no router flip shown before it:
    neither rounding nor a bug is shown (a bug inside a top-k MoE behind a row-parallel reduction read
    `rounding only`: tests/models/planted/moe_late_bug.py)."""
    return bool(_row(ev, "oracle_flip")) and ev.record.get("root_cause") is not True and ev.after_flip is None


def _flip_unshown_why(ev: Evidence, below) -> str:
    from tpdiag.diff.oracle import describe as describe_far

    v = next((v for v in _verdicts(ev) if v.get("far") and v.get("discrete")), None)
    if v is None:
        return "far from its float64 re-execution with a discrete choice inside: neither rounding nor a bug is shown"
    what = ", ".join(v.get("discrete") or ())
    if v.get("no_reference"):
        return (f"{describe_far(v)}: the reference itself is more than {v['margin']:g} roundings from it - the "
                f"float64 run chose otherwise at its discrete choices ({what}) - so it is no reference: neither "
                "rounding nor a bug is shown")
    return (f"{describe_far(v)}: far from it, with a discrete choice on floating values inside ({what}) that a "
            "rounding difference could flip - but no router flip is shown and its choices were not recorded "
            "equal, so neither rounding nor a bug is shown")


def _is_bug(v: Verdict) -> bool:
    return cause_class(v.cause) == "bug"


def baseline_cause(fd: dict | None, degree: int) -> str:
    """Why the reference rerun differs from itself: a collective (only at TP > 1), or else an
    op/kernel - the first non-reproducible record is an op that is no collective, or TP=1."""
    op = (fd or {}).get("op")
    if op and not any(c in op for c in COLLECTIVE_OPS):
        return "nondeterministic-kernel"
    return "collective-nondeterminism" if degree > 1 else "nondeterministic-kernel"


def _axis_applies(ev: Evidence, below, axis: str) -> bool:
    # a configuration on another axis runs the same layout and rows: what differs is how many
    # rows share a call - unless the record's own evidence shows a wrong result, or shows no
    # rounding (far with a choice that may have flipped; an input whose op nothing judged)
    return ev.axis == axis and cause_class(below().cause) not in ("bug", "non-finite") and not (
        _row_axis(ev) and (_far_discrete(ev) or _input_unjudged(ev)))


def _verdicts(ev: Evidence) -> list:
    """The record's float64 verdicts: its module's, its op's."""
    return [v for v in (ev.record.get("oracle"), ev.record.get("op_oracle"), ev.op_oracle) if isinstance(v, dict)]


def _row_axis(ev: Evidence) -> bool:
    return ev.axis in ("micro_batch", "mode")


def _far_discrete(ev: Evidence) -> bool:
    # far from float64 with a discrete choice inside that could have flipped: a flipped near tie
    # and a row that depends on its call's other rows move the output alike
    return any(v.get("far") and v.get("discrete") for v in _verdicts(ev))


def _input_unjudged(ev: Evidence) -> bool:
    # an input that differs although every earlier record was equal: computed in the caller's own
    # code, and no op there was judged near its float64 value (a view or slice is not recorded),
    # nor the caller's output, re-executed whole in float64 from its bitwise-equal inputs (a
    # sliding-window decode's attention over its cache: an op stream prefill does not run)
    return ev.record.get("kind") == "in" and not (ev.op_oracle is not None and not ev.op_oracle.get("far")) \
        and not (ev.caller_oracle is not None and not ev.caller_oracle.get("far"))


def _row_bug_why(ev: Evidence, below) -> str:
    same = next((v["choices_equal"] for v in _verdicts(ev) if v.get("far") and v.get("choices_equal")), None)
    return ("its inputs were bitwise equal" + (f" and so were its discrete choices ({', '.join(same)}: "
            "no flipped tie)" if same else "") + f", yet it is far from its float64 re-execution: "
            f"{why_piece_state(ev) or WHY_ROWS[ev.axis]}")


def why_piece_state(ev: Evidence) -> str | None:
    """Along the micro-batch axis, a module holding a buffer that an earlier micro-batch's forward
    wrote in the same step (diff/engine._mark_piece_state): a later piece reads what the piece before
    it wrote, where one call over the whole batch read the value the step started with."""
    got = (ev.row or {}).get("piece_state") or ev.record.get("piece_state")
    if ev.axis != "micro_batch" or not got:
        return None
    names = ", ".join(sorted(got))
    where = sorted({s for sides in got.values() for s in sides})
    return (f"it reads state its own forward writes (buffer {names}): a later micro-batch's call reads what "
            f"the micro-batch before it wrote in the same step ({' and '.join(where)}), where a call over "
            "more rows read the value the step started with - the micro-batch size changes what it "
            "computes, not its rounding")


def _why_unknown(ev: Evidence, below) -> str | None:
    from tpdiag.diff.generic_bound import why_unknown

    why = why_unknown(ev.row)
    refused = _row(ev, "oracle_refused")
    return f"{why}; its float64 re-execution was refused: {refused}" if refused else why


def _random_first_op(ev: Evidence, below) -> bool:
    from tpdiag.records.ops import RANDOM_OPS

    return is_op_of(ev.op, RANDOM_OPS) and below().cause == "unknown"


def _discrete_why(ev: Evidence, below) -> str:
    return (f"{ev.op} is far from its float64 re-execution, but it makes a discrete choice on "
            "floating values that a rounding difference can flip")


def _pick_why(ev: Evidence, below) -> str:
    from tpdiag.records.keys import RecordKey

    r = ev.record
    where = f"in the forward code of {r.get('module')}"
    if r.get("kind") == "in":
        where += f", computing input {r.get('name')} of {RecordKey.parse(r['key']).module}"
    return (f"{ev.op} {where} picks elements of one of the model's own parameters or buffers "
            "(recorded beside it, bitwise equal at both sides) and computes no number, so no rounding moves "
            "it: it picked other elements - a wrong position, offset or shard")


def _caller_why(ev: Evidence, below) -> str:
    from tpdiag.records.keys import RecordKey

    r, v = ev.record, ev.caller_oracle
    at = f" (the first op that differs: {ev.op})" if ev.op else ""
    why = (f"input {r.get('name')} of {RecordKey.parse(r['key']).module} is computed in the forward code of "
           f"{r.get('module')}{at}; {r.get('module')}'s inputs were bitwise equal, and its output, re-executed "
           f"whole in float64, is {v['ratio']:.2g}x beyond rounding: its code computes another function from "
           "here on (this input, or a module it calls after it) - a wrong result, not a reordering")
    far = v.get("far_op")
    if far and far["record"] != r.get("op_record"):
        line = f" at {far['at']}" if far.get("at") else ""
        why += (f"; the first of its ops far from its float64 re-execution is {far['op']}{line} "
                f"({far['ratio']:.2g}x beyond rounding), after {ev.op}, which is within rounding")
    return why


def _caller_near_why(ev: Evidence, below) -> str:
    from tpdiag.records.keys import RecordKey

    r, v = ev.record, ev.caller_oracle
    return (f"input {r.get('name')} of {RecordKey.parse(r['key']).module} is computed in the forward code of "
            f"{r.get('module')}, whose first op that differs is the collective {ev.op}: the ranks' partial "
            f"results added in another order; {r.get('module')}'s inputs were bitwise equal, and its output, "
            f"re-executed whole in float64, is within rounding ({v['ratio']:.2g}x its allowance)")
