"""Tamper suite, findings that name no record (red team hred21): the gate judged each diff.csv row by
the LAST finding of its (step, phase, module, kind, name) - no call index, no key - while every
integrity check finds a finding's record by its `key` and passed over one without. So, on a BUG run:

- a rounding copy of the bug's finding, its `key` deleted, appended to `findings`: `gate --allow
  rounding` exit 0 (the copy judged the bug's row; no check read the copy);
- the bug's finding and first divergence with their keys deleted, relabelled rounding: exit 0.

Both are now inconclusive (exit 2: records/numbers.unkeyed - compare writes a key on every one), and
the gate itself judges a row by the gravest finding that names it (gate/findings.by_record), so the
first edit fails as the BUG even where the key check is not run.

One real compare: tests/models/planted/backward.py:averaged at TP=1,2 (a hand-rolled column-parallel
layer whose weight grad is averaged over the TP ranks where it must be summed: a sharding-bug at its
param_grad, found by the float64 backward of the op-level second pass). Each case edits a copy.
"""
import copy
import json
import shutil

import pytest

from conftest import planted_shared, run_cli
from tpdiag.records.causes import EXIT_BUG


@pytest.fixture(scope="module")
def bug_run(tmp_path_factory):
    return planted_shared(tmp_path_factory, "backward", "averaged", "--tp", "1,2")[0]


@pytest.fixture()
def run(bug_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(bug_run, dst)
    # the second pass is named by absolute path: the copy's own
    for p in dst.rglob("*.json"):
        t = p.read_text()
        if str(bug_run) in t:
            p.write_text(t.replace(str(bug_run), str(dst)))
    return dst


def _edit(run, fn):
    s = json.loads((run / "summary.json").read_text())
    fn(s["degrees"]["2"])
    (run / "summary.json").write_text(json.dumps(s))


def _gate(run):
    return run_cli("gate", str(run), "--allow", "rounding")


def _bug_finding(d):
    (f,) = [f for f in d["findings"] if f["cause"] == "sharding-bug"]
    assert (f["module"], f["kind"], f["name"]) == ("layer", "param_grad", "weight"), f
    return f


def _keyless_rounding_copy(d):
    c = copy.deepcopy(_bug_finding(d))
    c.pop("key")
    c["cause"] = "column-parallel-dgrad"
    d["findings"].append(c)


def _keys_deleted_relabelled(d):
    for f in [d["first_divergence"], *d["findings"]]:
        f.pop("key", None)
        f["cause"] = "column-parallel-dgrad"
    d["class"] = "rounding"


def test_the_unedited_run_is_a_bug(bug_run):
    p = _gate(bug_run)
    assert p.returncode == EXIT_BUG, p.stdout + p.stderr


@pytest.mark.parametrize("edit", [_keyless_rounding_copy, _keys_deleted_relabelled])
def test_a_finding_or_first_divergence_without_its_record_key_is_inconclusive(run, edit):
    _edit(run, edit)
    p = _gate(run)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "has no record key" in p.stdout + p.stderr, p.stdout + p.stderr
    p = run_cli("report", str(run), "-o", str(run.parent / "r.html"))
    assert p.returncode == 2 and "has no record key" in p.stderr, p.stdout + p.stderr


def test_the_gate_judges_a_row_by_its_gravest_finding(run, monkeypatch):
    """Without the key check (as if a later check let a keyless finding through), the keyless rounding
    copy still does not judge the BUG's row: the finding whose key names the row, the gravest, does."""
    from tpdiag.gate import evaluate, load_policy
    from tpdiag.gate.policy import with_allowed
    from tpdiag.records import numbers

    _edit(run, _keyless_rounding_copy)
    monkeypatch.setattr(numbers, "unkeyed", lambda d: None)
    res = evaluate(str(run), with_allowed(load_policy(None), "rounding"))
    assert not res.problems, res.problems
    assert res.exit_code == EXIT_BUG, res.lines()
    (v,) = res.degrees["2"].violations
    assert (v.module, v.kind, v.name, v.cause) == ("layer", "param_grad", "weight", "sharding-bug"), v
