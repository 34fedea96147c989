"""Issue 62 item 1: one ordered cause judge (diff/judge.py). The passes give evidence; RULES,
first match wins, turns it into the cause. Adding a cause is one registry entry plus one rule:
here a toy cause added in the test is named in a real (gloo, TP=1,2) run directory's summary,
classed by the registry and failed by the gate, and the same run without the rule is not."""
import shutil

import pytest

from tpdiag.diff import judge
from tpdiag.diff.judge import Evidence, Rule, describe, settle
from tpdiag.records import causes
from tpdiag.records.causes import EXIT_BUG, Cause

TOY = Cause("toy-rowwise-bug", "bug", "the toy rule calls every row-parallel output wrong",
            short="toy-row", action="Fix the toy.")
TOY_RULE = Rule("toy: a row-parallel output",
                lambda ev, below: ev.row is not None and ev.row.get("style") == "rowwise" and ev.row["kind"] == "out",
                lambda ev, below: TOY.label, lambda ev, below: "the toy rule saw a row-parallel output")


def _at(name: str) -> int:
    return next(i for i, r in enumerate(judge.RULES) if r.name == name)


def _reanalyse(src, tmp_path):
    """The real run's records judged again, in this process (where the test's rule is)."""
    from tpdiag.diff.analyse import analyse_run
    from tpdiag.gate.verdict import evaluate
    from tpdiag.records.rundir import read_summary

    run = tmp_path / "run"
    shutil.copytree(src, run)
    analyse_run(str(run), "1", ["2"], {}, 1)
    d = read_summary(str(run))["degrees"]["2"]
    return d, evaluate(str(run))


def test_a_new_cause_is_one_entry_and_one_rule(tp12_run, tmp_path, monkeypatch):
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    monkeypatch.setattr(judge, "RULES", judge.RULES[:_at("layout names the reordering")] + [TOY_RULE]
                        + judge.RULES[_at("layout names the reordering"):])
    d, gate = _reanalyse(tp12_run, tmp_path)
    fd = d["first_divergence"]
    assert fd["cause"] == TOY.label and fd["why"] == "the toy rule saw a row-parallel output", fd
    assert d["class"] == "bug"  # the registry's class
    assert gate.exit_code == EXIT_BUG and gate.first_violation.cause == TOY.label, gate.lines()


def test_negative_control_without_the_rule(tp12_run, tmp_path, monkeypatch):
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    d, gate = _reanalyse(tp12_run, tmp_path)
    assert d["first_divergence"]["cause"] == "row-parallel-reduction" and d["class"] == "rounding", d
    assert gate.exit_code != EXIT_BUG


def test_the_order_is_the_precedence(tp12_run, tmp_path, monkeypatch):
    # the same rule placed after the layout's: the layout names the record first, the toy never wins
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    at = _at("layout names the reordering") + 1
    monkeypatch.setattr(judge, "RULES", judge.RULES[:at] + [TOY_RULE] + judge.RULES[at:])
    d, _ = _reanalyse(tp12_run, tmp_path)
    assert d["first_divergence"]["cause"] == "row-parallel-reduction"


def _row(**kw):
    row = {"phase": "optimizer", "kind": "grad_norm", "style": None, "cls": None, "module": "model",
           "name": "total", "step": 0, "key": "s0/optimizer/model/grad_norm#0/total", "bitwise": False,
           "beyond_bound": True, "bound": 1e-9}
    row.update(kw)
    return row


def test_evidence_from_several_passes_is_judged_in_rule_order():
    # a grad norm beyond its bound (a bug by its row), between two TP=1 worlds (the TP=1 rule
    # clears it), of a micro-batch configuration (the axis rule names it): each overridden
    # cause is kept where the summary has always kept it
    row = _row()
    f = describe(row, {"kind": "grad_norm", "bound": 1e-9, "cause": None})
    assert f["cause"] == "sharding-bug" and "why" not in f
    v = settle(f, tp1_both=True)
    assert (f["cause"], f["cause_before"], v.rule) == ("grad-norm", "sharding-bug", "grad norm beyond its bound at TP=1")
    settle(f, axis="micro_batch")
    assert f["cause"] == "batch-variant-kernel" and f["layout_cause"] == "grad-norm" and f["cause_before"] == "sharding-bug"
    assert f["why"] == judge.WHY_AXIS["grad_norm"]
    # a float64 verdict that found it wrong stays a bug through both: no rule below clears it
    g = describe(row, {"kind": "grad_norm", "bound": 1e-9, "cause": None, "oracle": {"far": True}})
    settle(g, tp1_both=True)
    settle(g, axis="micro_batch")
    assert g["cause"] == "sharding-bug" and "layout_cause" not in g and "cause_before" not in g


def test_noise_and_non_finite():
    row = _row(nonfinite_mismatch=True)
    f = describe(row, {"kind": "grad_norm", "op": None, "cause": None})
    assert f["cause"] == "non-finite"
    settle(f, noise=1)  # a same-degree world: NaN/Inf is judged as a value
    assert f["cause"] == "non-finite"
    settle(f, noise_always=True)  # the reference's own rerun: its noise
    assert f["cause"] == "nondeterministic-kernel" and "nondeterministic run to run" in f["why"]


def test_a_record_read_back_keeps_its_recorded_verdict():
    f = {"cause": "row-parallel-reduction", "kind": "out"}
    assert settle(f).rule == "as recorded (read back from a summary)" and f["cause"] == "row-parallel-reduction"
    settle(f, axis="mode")
    assert f["cause"] == "batch-variant-kernel" and f["layout_cause"] == "row-parallel-reduction"
    with pytest.raises(AssertionError):
        judge.judge(Evidence(row=None, record={}), rules=[])
