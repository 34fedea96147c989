"""The one cause judge: a record's evidence in, its cause and the reason out.

The passes of diff/ gather EVIDENCE and name no cause: the diff engine and the bounds put bits,
bounds and float64 verdicts on each record's row; locate adds the first divergent op and that
op's float64 verdict; router.py the router flips; analyse.py a split weight tie, a same-degree
rerun, both worlds at TP=1; axis_cause.py the axis a configuration differs in. Each then calls
`settle(record, **evidence)`, and `judge` turns everything known so far into (cause, why).

RULES is the one ordered list: the first rule that matches wins, so its order IS the precedence
(before this file it was the order in which seven passes overwrote a shared dict). A rule may
look at the verdict of the rules after it (`below`): "a decode configuration's difference is a
batch-variant kernel unless what the record itself shows is a bug" reads exactly so.

Adding a cause: one entry in records/causes.py and one Rule here (see tests/test_judge.py, which
adds one in the test and sees it named in a real run directory). Evidence, Verdict, Rule and the
predicates the rules read are in judge_evidence.py.

The reruns give evidence too: the second pass's verdict on the same record and the op it named
(runner/drill.py), a finding found within rounding on its own inputs (drill.py), a confirmed fix
and the records it made bitwise (runner/confirm.py, diff/classes.py). A record read back from a
summary.json carries no evidence: its recorded verdict stands for the rules that would need it.
"""
from __future__ import annotations

from dataclasses import replace

from tpdiag.records.causes import cause_class
from tpdiag.diff import flip_shares
from tpdiag.diff.layout_cause import EMBED_CLASSES, NORM_CLASSES, op_kind, layout_cause  # noqa: F401
from tpdiag.diff.reasons import (WHY_ATTENTION, WHY_AXIS, WHY_COUPLED, WHY_DECODE, WHY_LOSS_MEAN, WHY_LOSS_REDUCED,  # noqa: F401
                                 WHY_MICRO_BATCH, WHY_NOISE, WHY_TP1)
from tpdiag.records.ops import ATTENTION_OPS, COLLECTIVE_OPS, PICK_OPS, SDPA_OPS, is_op_of
from tpdiag.records.share_rules import DRIFTED_SHARES, FLIP_SHARES, NEAR_SHARES
from tpdiag.diff.scale import drifted_shares_why, factor_why, narrowed_why, near_shares_why, scale_why, shares_why
# the evidence, the verdict and the predicates and reasons the rules below are written in
from tpdiag.diff.judge_evidence import (Evidence, Rule, Verdict, baseline_cause, judged_far, judged_near,
                                        why_at_op, _attention_op_why, _axis_applies, _caller_why, _caller_near_why,
                                        _discrete_why, _far_discrete, _flip_unshown_why, far_flip_unshown,
                                        _input_unjudged, _is_bug,
                                        _no_op_recorded, _op_pass_why, _pick_why, _random_first_op, _row,
                                        _row_axis, _row_bug_why, _verdicts, _why_unknown)

BATCH_VARIANT = "batch-variant-kernel"
FLIP_UNSHOWN = "far with a discrete choice inside, no flip shown"


# ---- the rules, first match wins ----------------------------------------------------------

CALLER_FAR = "the caller of a divergent input is far from float64"  # diff/locate.py names its far op

RULES: list[Rule] = [
    # a parameter after a capture's own optimizer step: its update re-run in float64 and the grads it
    # consumed set against the recorded ones (diff/optim_step.py) - only that chain of links says
    # anything of a record past the first divergence, which no other rule bounds
    Rule("a capture's optimizer step judged", lambda ev, b: ev.optimizer_step is not None,
         lambda ev, b: ev.optimizer_step[0], lambda ev, b: ev.optimizer_step[1]),
    # ... unless a record before it differed already: a shape the model computes from values (an MoE
    # router's top-k, a mask's nonzero, a capacity) changes with a rounding difference, so the shape
    # alone judges nothing either way - unless the code that made it could not let a value decide its
    # shape (diff/shape_break.settle's `by`: short_after is then None, and the next rule names the bug)
    Rule("the ranks hold part of the record after a difference",
         lambda ev, b: ev.short_of_whole is not None and ev.short_after is not None,
         lambda ev, b: "unknown", lambda ev, b: ev.short_of_whole),
    # the ranks together hold fewer elements than the reference's record: no reordering changes a
    # shape, and no rerun or fix can make a record bitwise that cannot be gathered
    Rule("the ranks hold part of the record", lambda ev, b: ev.short_of_whole is not None,
         lambda ev, b: "sharding-bug", lambda ev, b: ev.short_of_whole),
    # a grad hook of the user's that runs at the reference and not here (the plan replaced its
    # parameter): the degrees train different functions, whatever a rerun or a fix shows
    Rule("a grad hook the plan dropped", lambda ev, b: ev.dropped_hook is not None,
         lambda ev, b: "sharding-bug", lambda ev, b: ev.dropped_hook),
    # a confirmed fix (runner/confirm.py): fixes that only reorder cannot turn a wrong result right
    Rule("a confirming fix makes it bitwise",
         lambda ev, b: ev.confirmed is not None and ev.confirmed["bitwise"] and _is_bug(b()),
         lambda ev, b: ev.confirmed["cause"],
         lambda ev, b: (f"the confirming fix ({ev.confirmed['fix']}) makes this record bitwise "
                        "equal: fixes that only reorder cannot turn a wrong result right"), keep="cause_before"),
    Rule("downstream of a confirmed cause, near float64",
         lambda ev, b: (ev.confirmed is not None and _is_bug(b()) and judged_near(ev.record)
                        and b().cause == "sharding-bug" and ev.record.get("bound") is not None),
         lambda ev, b: ev.confirmed["cause"],
         lambda ev, b: (f"downstream of the confirmed {ev.confirmed['cause']} ({ev.confirmed['fix']}) and "
                        "its float64 re-execution found it within rounding"), keep="cause_before"),
    # the second pass (runner/drill.py)
    Rule("within rounding on its own inputs",
         lambda ev, b: (ev.own_near is not None and b().cause == "sharding-bug"
                        and ev.record.get("bound") is not None and not ev.record.get("oracle")),
         lambda ev, b: ev.own_near if cause_class(ev.own_near) == "rounding" else "unknown",
         lambda ev, b: ("beyond its layout bound, which assumed inputs equal to the reference's; re-executed in "
                        "float64 from this side's own inputs it is within rounding: not a bug"), keep="cause_before"),
    Rule("the op-level rerun names an attention kernel",
         lambda ev, b: ev.op_pass is not None and ev.op_pass[1] == "attention-kernel",
         lambda ev, b: "attention-kernel", _op_pass_why),
    Rule("the op-level rerun names the op", lambda ev, b: ev.op_pass is not None and _no_op_recorded(b()),
         lambda ev, b: "unknown", _op_pass_why),
    # the first op that differs draws random numbers (a dropout mask drawn per shard): the degrees
    # compute different functions, which no bound or float64 re-execution can judge
    Rule("the first divergent op is a random draw", _random_first_op,
         lambda ev, b: "unknown", lambda ev, b: why_at_op(ev.op, ev.axis)),
    Rule("the second pass judged it", lambda ev, b: ev.second is not None,
         lambda ev, b: ev.second[0], lambda ev, b: ev.second[1]),
    # the configuration: what differs from the reference besides TP
    # micro-batch and decode: what the record itself shows comes before "only the rows per call
    # changed" - a far float64 verdict on equal inputs is a bug with its reason; far with a choice
    # that could have flipped, or an input whose op nothing judged, shows no rounding either
    Rule("far on equal inputs, along the micro-batch or decode axis",
         lambda ev, b: (_row_axis(ev) and ev.record.get("kind") in ("out", "op") and _is_bug(b())
                        and any(v.get("far") for v in _verdicts(ev)) and not b().why),
         lambda ev, b: b().cause, _row_bug_why),
    Rule("loss beyond its bound across micro-batch sizes",
         lambda ev, b: (ev.axis == "micro_batch" and ev.record.get("kind") == "loss"
                        and ev.record.get("root_cause") is True  # the first divergence: logits equal
                        and b().cause == "sharding-bug" and not b().why),
         lambda ev, b: b().cause, lambda ev, b: WHY_LOSS_MEAN),
    Rule("attention implementation differs", lambda ev, b: _axis_applies(ev, b, "attention"),
         lambda ev, b: "attention-kernel", lambda ev, b: WHY_ATTENTION, keep="layout_cause"),
    Rule("decode vs prefill", lambda ev, b: _axis_applies(ev, b, "mode"),
         lambda ev, b: "attention-kernel" if is_op_of(ev.op, SDPA_OPS) else BATCH_VARIANT,
         lambda ev, b: WHY_DECODE, keep="layout_cause"),
    Rule("micro-batch size differs", lambda ev, b: _axis_applies(ev, b, "micro_batch"),
         lambda ev, b: BATCH_VARIANT, lambda ev, b: WHY_AXIS.get(ev.record.get("kind"), WHY_MICRO_BATCH),
         keep="layout_cause"),
    # what the axis rules above leave alone: no rounding shown (fail closed)
    Rule("far with a discrete choice inside, along the micro-batch or decode axis",
         lambda ev, b: _row_axis(ev) and _far_discrete(ev) and cause_class(b().cause) not in ("bug", "non-finite"),
         lambda ev, b: "unknown",
         lambda ev, b: (f"{b().why or 'far from its float64 re-execution, with a discrete choice inside'}; "
                        f"with its inputs bitwise equal, {WHY_COUPLED[ev.axis]}")),
    Rule("an input no op judged, along the micro-batch or decode axis",
         lambda ev, b: (_row_axis(ev) and _input_unjudged(ev) and b().cause == "unknown"),
         lambda ev, b: "unknown",
         lambda ev, b: (f"{ev.record.get('detail', 'an input differs')}; no op there was judged against its "
                        "float64 re-execution (a view or indexing op is not recorded), so neither rounding nor "
                        "a bug is shown")),
    # a rerun at the reference's own degree: no TP layout explains a difference; NaN/Inf is
    # judged as a value (at both worlds alike too) except in the reference's own rerun
    Rule("rerun at the reference's degree",
         lambda ev, b: ev.noise is not None and (ev.noise_always or b().cause != "non-finite"),
         lambda ev, b: baseline_cause({"op": ev.op}, ev.noise),
         lambda ev, b: WHY_NOISE if baseline_cause({"op": ev.op}, ev.noise) == "nondeterministic-kernel" else None),
    # between two TP=1 worlds the grad norm's triangle bound is too tight for a GPU's serial
    # reduce runs (diff/classes.py no_sharding_at_tp1): a bug only where float64 found it wrong
    Rule("grad norm beyond its bound at TP=1",
         lambda ev, b: (ev.tp1_both and ev.record.get("kind") == "grad_norm" and b().cause == "sharding-bug"
                        and ev.record.get("bound") is not None and not judged_far(ev.record)),
         lambda ev, b: "grad-norm", lambda ev, b: WHY_TP1, keep="cause_before"),
    # records of their own kind
    Rule("router flip after the first divergence", lambda ev, b: ev.flip == "consequence",
         lambda ev, b: "router-flip"),
    Rule("router flip with nothing before it", lambda ev, b: ev.flip == "root", lambda ev, b: "unknown"),
    Rule("split weight tie", lambda ev, b: ev.broken_tie, lambda ev, b: "sharding-bug"),
    # a per-rank block (runner/per_rank.py) whose left-out weights are none of the reference's: each
    # rank runs a model of its own (experts seeded per rank), whatever the block's output shows
    Rule("per-rank weights not the reference's", lambda ev, b: ev.not_reference is not None,
         lambda ev, b: "rank-inconsistent-replica", lambda ev, b: ev.not_reference),
    # ... beyond its bound on token rows the flip did not flip, and which rows a token mixer carried it
    # into not told (no batch record): neither the flip's consequence nor a bug shown (diff/flip_rows.py)
    Rule("after a router flip, its rows not told",
         lambda ev, b: ev.flip_untold is not None and b().rule == "after a router flip",
         lambda ev, b: "unknown", lambda ev, b: ev.flip_untold),
    # a finding after a real router flip: tokens that ran other experts are beyond any bound - unless
    # its float64 verdict followed each side's own choices, flipped tokens included (diff/choices_made.py)
    Rule("after a router flip", lambda ev, b: ev.after_flip is not None and (
             b().cause == "sharding-bug" or bool(_row(ev, "oracle_flip")))
         and not (_row(ev, "oracle") or {}).get("choices_made"),
         lambda ev, b: "router-flip", lambda ev, b: b().why),
    # the first divergent op, re-executed in float64, judges what its module record could not
    Rule("a pick of the model's own tensor differs",
         lambda ev, b: (ev.op_oracle is not None and ev.op_oracle["far"] and ev.op in PICK_OPS
                        and ev.source_equal is True),
         lambda ev, b: "sharding-bug", _pick_why),
    # an input computed by code no op judged: the code that computed it (its caller), re-executed
    # whole in float64 from its bitwise-equal inputs, is far - it computes another function
    Rule(CALLER_FAR,
         lambda ev, b: (ev.record.get("kind") == "in" and ev.caller_oracle is not None and ev.caller_oracle["far"]
                        and not ev.caller_oracle.get("discrete") and (ev.op_oracle is None or not ev.op_oracle["far"])
                        # the op that computed it judged near, and a module called after it far on its
                        # own inputs: that module is the caller's far, not this input (its own finding)
                        and not (ev.op_oracle is not None and ev.caller_oracle.get("explained_by"))
                        and cause_class(b().cause) != "bug"),
         lambda ev, b: "sharding-bug", _caller_why),
    # ... and near it, the first op that differs the collective that sums the ranks' partial results
    # (the user's own all-reduce of a sum of squares over an FFN shard, feeding its down projection):
    # the caller computes the same function, its partial sums added in another order. It read
    # `unknown` ("no rule judged it"), under `--fix auto` the run's whole verdict "not judged"
    Rule("the caller of a divergent input is near float64, at its collective",
         lambda ev, b: (ev.record.get("kind") == "in" and ev.caller_oracle is not None
                        and not ev.caller_oracle["far"] and ev.op_oracle is None and ev.axis == "tp"
                        and bool(ev.op) and any(c in ev.op for c in COLLECTIVE_OPS) and b().cause == "unknown"),
         lambda ev, b: "row-parallel-reduction", _caller_near_why),
    Rule("op far from its float64 re-execution",
         lambda ev, b: ev.op_oracle is not None and ev.op_oracle["far"] and not ev.op_oracle.get("discrete"),
         lambda ev, b: "sharding-bug"),
    Rule("op far from float64, but a discrete choice",
         lambda ev, b: ev.op_oracle is not None and ev.op_oracle["far"], lambda ev, b: "unknown", _discrete_why),
    # an attention kernel whose inputs were bitwise equal (the reason below stays, as it always has)
    Rule("attention op, inputs equal",
         lambda ev, b: (ev.op_oracle is None and is_op_of(ev.op, ATTENTION_OPS) and not _row(ev, "beyond_bound")
                        and b().cause not in ("rank-inconsistent-replica", "sharding-bug")),
         lambda ev, b: "attention-kernel", _attention_op_why),
    Rule("op near its float64 re-execution", lambda ev, b: ev.op_oracle is not None,
         lambda ev, b: op_kind(ev.op)),
    # the record's own bits, ranks and bound
    Rule("as recorded (read back from a summary)", lambda ev, b: ev.row is None,
         lambda ev, b: ev.record.get("cause") or "unknown", lambda ev, b: ev.record.get("why"),
         tag=lambda ev, b: ev.record.get("rule")),
    Rule("non-finite", lambda ev, b: bool(_row(ev, "nonfinite_mismatch")), lambda ev, b: "non-finite"),
    # a per-rank statistic no recorded step reads (diff/replicas.py): its replicas differ, but no
    # result of the model's numerics is shown wrong
    Rule("a replica no recorded step reads",
         lambda ev, b: _row(ev, "rank_consistent") is False and (_row(ev, "replica_read") or {}).get("read") is False,
         lambda ev, b: "unknown", lambda ev, b: _row(ev, "replica_read")["why"]),
    # ... or whose only reader in sight is a module that varies per rank by itself (diff/replicas._varies):
    # no step is shown to read it, and nothing shown wrong - unknown, with the reason
    Rule("a replica beside a module that varies per rank",
         lambda ev, b: _row(ev, "rank_consistent") is False and (_row(ev, "replica_read") or {}).get("varies") is True,
         lambda ev, b: "unknown", lambda ev, b: _row(ev, "replica_read")["why"]),
    Rule("shares that do not add up", lambda ev, b: _row(ev, "rank_consistent") is False and bool(_row(ev, "shares_of")),
         lambda ev, b: "sharding-bug", lambda ev, b: shares_why(_row(ev, "shares_of"))),
    # an activation grad whose ranks' copies add up to the reference within a few roundings of the
    # tensor's largest magnitude but not element by element (diff/partials.near_shares): shares whose
    # cancelling terms the record does not hold - neither rounding nor a bug shown
    Rule("shares near the reference, not element by element",
         lambda ev, b: _row(ev, "rank_consistent") is False and bool(_row(ev, "rank_partial_near")),
         lambda ev, b: "unknown", lambda ev, b: near_shares_why(_row(ev, "rank_partial_near")),
         tag=lambda ev, b: NEAR_SHARES),
    # ... or on the token rows a router flip left alone (diff/flip_shares.py): the flipped rows are another
    # computation; the others add up (the flip's consequence) or add up within the band (not judged)
    Rule("shares on the rows a router flip left alone",
         lambda ev, b: _row(ev, "rank_consistent") is False and bool(_row(ev, "rank_partial_flip")),
         lambda ev, b: "unknown" if _row(ev, "rank_partial_flip")["near"] else "router-flip",
         lambda ev, b: flip_shares.why(_row(ev, "rank_partial_flip")), tag=lambda ev, b: FLIP_SHARES),
    # ... and the same activation grad at a step whose weights differ, shown shares at the first step
    # (diff/partials.drifted_grad_shares): they add up to this side's drifted sum - neither shown
    Rule("shares at a step whose weights differ",
         lambda ev, b: _row(ev, "rank_consistent") is False and bool(_row(ev, "rank_partial_drifted")),
         lambda ev, b: "unknown", lambda ev, b: drifted_shares_why(_row(ev, "rank_partial_drifted")),
         tag=lambda ev, b: DRIFTED_SHARES),
    Rule("ranks differ", lambda ev, b: _row(ev, "rank_consistent") is False,
         lambda ev, b: "rank-inconsistent-replica", lambda ev, b: (_row(ev, "replica_read") or {}).get("why")),
    Rule("beyond its rounding bound", lambda ev, b: bool(_row(ev, "beyond_bound")), lambda ev, b: "sharding-bug",
         lambda ev, b: narrowed_why(_row(ev, "narrowed")) or factor_why(_row(ev, "loss_factor"), "loss")
         or factor_why(_row(ev, "far_scale"), "far")),
    # no bound needed: one factor times the reference's whole tensor (diff/scale.py)
    Rule("the reference's times one factor", lambda ev, b: _row(ev, "scale") is not None,
         lambda ev, b: "sharding-bug", lambda ev, b: scale_why(_row(ev, "scale"), _row(ev, "scale_of"))),
    # a loss whose logits were whole at every rank and bitwise equal: no vocab shard, so no
    # vocab-parallel softmax; what moved it is the loss function's own sum of per-rank partials
    # (planted sp_loss_mean.py:sp_token_mean - each rank's token sum, all-reduced - read
    # vocab-parallel-softmax, whose fix never confirmed: nothing of the vocab is split)
    Rule("a loss from whole, equal logits",
         lambda ev, b: (ev.axis == "tp" and layout_cause(ev.row) == "vocab-parallel-softmax"
                        and bool(_row(ev, "logits_whole"))),
         lambda ev, b: "row-parallel-reduction", lambda ev, b: WHY_LOSS_REDUCED),
    # far from float64 past the first divergence with a choice inside that may have flipped, and no
    # flip shown: fail closed (a layout's reordering name would read it rounding)
    Rule(FLIP_UNSHOWN, far_flip_unshown, lambda ev, b: "unknown", _flip_unshown_why),
    Rule("layout names the reordering", lambda ev, b: layout_cause(ev.row) is not None,
         lambda ev, b: layout_cause(ev.row)),
    Rule("nothing names it", lambda ev, b: True, lambda ev, b: "unknown", _why_unknown),
]


def judge(ev: Evidence, rules: list[Rule] | None = None) -> Verdict:
    """The cause of the first rule in `rules` (RULES) that matches `ev`, with its reason."""
    rules = RULES if rules is None else rules
    for i, rule in enumerate(rules):
        memo: list[Verdict] = []

        def below(i=i, memo=memo) -> Verdict:
            if not memo:
                memo.append(judge(ev, rules[i + 1:]))
            return memo[0]

        if rule.when(ev, below):
            kept = dict(memo[0].kept) if memo else {}
            if rule.keep:
                kept[rule.keep] = below().cause
            return Verdict(rule.cause(ev, below), rule.why(ev, below), rule.name, kept, rule.tag(ev, below))
    raise AssertionError("the last rule matches every record")


class Described(dict):
    """A first divergence or finding as the summary holds it, carrying the evidence its cause was
    judged from (an attribute: json writes the dict, and a copy read back has only its verdict)."""
    evidence: Evidence | None = None


def describe(row: dict | None, fields: dict, **evidence) -> Described:
    """A new described record for `row`, judged from its evidence."""
    d = Described(fields)
    d.evidence = Evidence(row=row, record=d, **evidence)
    settle(d)
    return d


def settle(record: dict, **evidence) -> Verdict:
    """Add `evidence` to what is known of `record`, judge it and write its cause (the only
    writer of `cause` in diff/): cause, why (removed when the verdict gives none), the rule's
    structured name (`rule`, removed likewise) and the overridden cause where a rule keeps it."""
    ev = getattr(record, "evidence", None) or Evidence(row=None, record=record, op=record.get("op"))
    ev = replace(ev, **evidence)
    if isinstance(record, Described):
        record.evidence = ev
    v = judge(ev)
    record["cause"] = v.cause
    if v.why:
        record["why"] = v.why
    else:
        record.pop("why", None)
    if v.tag:
        record["rule"] = v.tag
    else:
        record.pop("rule", None)
    record.update(v.kept)
    return v
