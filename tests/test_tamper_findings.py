"""Tamper suite, the findings (issue 58): the gate judges every record beyond its rounding bound or
inconsistent across ranks on its own, whatever summary.json says about it. A finding deleted from
summary.json is inconclusive (diff.csv, re-derived from the records, still has the record), and a
`follows` written into a bug finding - grouping it under a harmless rounding difference, or under a
record that does not exist - no longer hides it.

One real compare: tests/models/planted/behind.py:bugs at TP=1,2, whose first divergence is a
correct row-parallel all-reduce (rounding) with a never-reduced norm weight grad (a
rank-inconsistent replica) and an averaged k/v weight grad behind it. On ed1fba1, under a policy
allowing the first divergence's cause, both `follows` cases and the deletion of every finding passed
the gate (exit 0); a single deletion still failed on the other bug, but was not called an edit.
"""
import json
import shutil

import pytest

from tpdiag.gate import evaluate, load_policy
from tpdiag.records.causes import EXIT_BUG, cause_class


@pytest.fixture(scope="session")
def behind_run(behind_bugs_run):
    return behind_bugs_run  # conftest's session run, test_behind's float32 `bugs` case too


@pytest.fixture()
def run(behind_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(behind_run, dst)
    return dst


def _policy(run, tmp_path):
    """Allows the first divergence's (rounding) cause only: the bugs behind it must still fail."""
    fd = json.loads((run / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    assert cause_class(fd["cause"]) == "rounding", fd
    p = tmp_path / "allow.toml"
    p.write_text(f'allow_causes = ["{fd["cause"]}"]\n')
    return load_policy(str(p))


def _edit(run, fn):
    s = json.loads((run / "summary.json").read_text())
    fn(s["degrees"]["2"])
    (run / "summary.json").write_text(json.dumps(s))


def _follow(target):
    def edit(d):
        fd = d["first_divergence"]["key"]
        for f in d["findings"]:
            f.setdefault("follows", fd if target == "fd" else target)
    return edit


def _drop(pred):
    return lambda d: d.update(findings=[f for f in d["findings"] if not pred(f)])


def test_the_untouched_run_fails_on_its_bugs(run, tmp_path):
    res = evaluate(str(run), _policy(run, tmp_path))
    assert res.exit_code == EXIT_BUG and res.bug, res.lines()
    roots = [f for f in json.loads((run / "summary.json").read_text())["degrees"]["2"]["findings"]
             if "follows" not in f and cause_class(f["cause"]) == "bug"]
    assert {f["module"] for f in roots} >= {"norm", "kv"}, roots  # the fixture holds what the cases edit


@pytest.mark.parametrize("case,edit", [
    ("every finding follows the rounding first divergence", _follow("fd")),
    ("every finding follows a record that does not exist", _follow("s0/forward/nowhere/out#0/0")),
])
def test_a_written_in_follows_hides_no_bug(run, tmp_path, case, edit):
    policy = _policy(run, tmp_path)
    _edit(run, edit)
    res = evaluate(str(run), policy)
    assert res.exit_code == EXIT_BUG and res.bug, (case, res.lines())


@pytest.mark.parametrize("case,edit", [
    ("the rank-inconsistent root deleted", _drop(lambda f: f["module"] == "norm" and f["kind"] == "param_grad")),
    ("every finding deleted", _drop(lambda f: True)),
])
def test_a_deleted_finding_is_inconclusive(run, tmp_path, case, edit):
    policy = _policy(run, tmp_path)
    _edit(run, edit)
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    assert "findings lack" in res.lines()[0], res.lines()[0]


def test_only_the_second_pass_s_finding_deleted_is_inconclusive(run, tmp_path):
    """The averaged k/v weight grad is found only by the second pass (judged on its own inputs), so
    diff.csv does not mark it: its deletion from summary.json is caught against the second pass's
    own summary (RUN_DIR/ops/summary.json)."""
    policy = _policy(run, tmp_path)
    _edit(run, _drop(lambda f: f.get("from") == "second pass"))
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and "second pass" in res.lines()[0] and "ops/summary.json" in res.lines()[0], \
        res.lines()


def test_an_untouched_run_whose_second_pass_found_an_op_is_judged_not_inconclusive(branches_bugs_run):
    """The flip side: a finding the second pass made on an op only it recorded (the LayerNorm over a
    column shard, found at aten::native_layer_norm) is not a record of the main diff.csv. On ed1fba1
    the gate called this genuine run inconclusive for it (exit 2); it fails on its bugs (exit 4), the
    LayerNorm's among them rather than grouped under an op the gate never judges."""
    run = branches_bugs_run  # conftest's session run (TP=1,2,4; test_planted's catalogue reads it too)
    res = evaluate(str(run))
    assert res.exit_code == EXIT_BUG and not res.problems, res.lines()
    assert any(v.module == "branch.norm" and cause_class(v.cause) == "bug" for v in res.degrees["2"].violations), \
        res.lines()


def test_a_finding_relabelled_as_rounding_is_inconclusive(run, tmp_path):
    """The rank-inconsistent norm grad given the allowed rounding cause in summary.json alone: diff.csv
    (re-derived from the records) still has the record inconsistent across ranks, which locate names a
    bug and no later pass relabels without saying so (cause_before). On ed1fba1: judged allowed."""
    policy = _policy(run, tmp_path)
    allowed = next(iter(policy.allow_causes))

    def relabel(d):
        for f in d["findings"]:
            if f["module"] == "norm" and f["kind"] == "param_grad":
                f["cause"] = allowed
    _edit(run, relabel)
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and "a rounding label" in res.lines()[0], res.lines()


def _unknown_under_fd(d):
    """Every finding `unknown` (not bug-class, so no longer demanded a bug label for its record) and written to
    follow the rounding first divergence - grouped under it, never judged."""
    fd = d["first_divergence"]["key"]
    for f in d["findings"]:
        f.update(cause="unknown", follows=fd)
        f.pop("why", None)


def test_bugs_relabelled_unknown_under_the_first_divergence_do_not_pass(run, tmp_path):
    """red team hred13. On 170f498 summary.json edited so (its classes left as they were: the roots' are
    the rounding first divergence's) passed a policy allowing that cause (exit 0); so did the second pass's
    ops/summary.json edited the same way beside it. Now summary.json alone is inconclusive (the second pass
    judged those records bugs: records/labels.pass_label_problems), and with both edited the gate groups
    no `unknown` under a first divergence that is no finding, so it judges them (gate/findings.grouped)."""
    policy = _policy(run, tmp_path)
    _edit(run, _unknown_under_fd)
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and "the second pass in ops/ judged it" in res.lines()[0], res.lines()
    sub = json.loads((run / "ops" / "summary.json").read_text())
    _unknown_under_fd(sub["degrees"]["2"])
    (run / "ops" / "summary.json").write_text(json.dumps(sub))
    res = evaluate(str(run), policy)
    assert res.exit_code == 1 and not res.problems, res.lines()
    assert {(v.module, v.cause) for v in res.degrees["2"].violations} >= {("norm", "unknown"), ("kv", "unknown")}, \
        res.lines()
