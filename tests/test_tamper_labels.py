"""Tamper suite, the labels (red team hred13): a BUG run's summary.json relabelled rounding must not pass.

One real compare: tests/models/planted/moe_accum.py:local_index at TP=1,2 (an MoE indexing its experts by
the rank's LOCAL number). Its first divergence, the MoE's output, has no layout bound: the second pass's
float64 re-execution judges it, sharding-bug, 7.6e5x beyond rounding; a rank-inconsistent router grad and
three findings beyond their bounds follow it. On 170f498 each edit below, of summary.json alone (and the
second pass's folders deleted, in the last case), passed `gate --allow rounding` (exit 0):

- `router-flip` (class rounding) written onto the findings after the first divergence relabelled
  row-parallel-reduction: no expert choice differs anywhere in diff.csv (records/labels.flip_problems);
- the findings relabelled `unknown` (grouped under the first divergence, so never judged): the second
  pass judged that first divergence sharding-bug (records/labels.pass_label_problems);
- the second pass removed altogether (its folders, summary.json's `second_pass`, the first divergence's
  float64 verdict): a first divergence with no bound in diff.csv has no evidence for a rounding label
  (records/labels.unjudged_problems).
Each is now inconclusive (exit 2) for gate, `gate --format json` and report.
"""
import glob
import json
import shutil

import pytest
from conftest import run_cli

from tpdiag.gate import evaluate, load_policy, with_allowed
from tpdiag.records.causes import EXIT_BUG

FD = "s0/forward/moe/out#0/0"


@pytest.fixture(scope="module")
def moe_bug(moe_accum_run):
    out = moe_accum_run[0]  # the compare, shared with test_oracle_factories (conftest); edited as copies
    fd = json.loads((out / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    assert (fd["key"], fd["cause"]) == (FD, "sharding-bug") and fd["oracle"]["far"], fd
    return out


@pytest.fixture()
def run(moe_bug, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(moe_bug, dst, symlinks=True)
    return dst


def _rounding():
    return with_allowed(load_policy(None), "rounding")


def _relabel(run, others, strip_pass=False):
    """summary.json alone: the first divergence (and its own finding) row-parallel-reduction, every other
    finding `others`, the classes rounding; strip_pass: the second pass gone too."""
    s = json.loads((run / "summary.json").read_text())
    e = s["degrees"]["2"]
    fd = e["first_divergence"]
    fd["cause"] = "row-parallel-reduction"
    fd.pop("why", None)
    if strip_pass:
        for k in ("second_pass_dir", "oracle", "bound_model", "op_detail"):
            fd.pop(k, None)
        s.pop("second_pass", None)
        for d in glob.glob(str(run / "ops*")):
            shutil.rmtree(d)
    for f in e["findings"]:
        f["cause"] = fd["cause"] if f["key"] == FD else others
        f.pop("why", None)
        if strip_pass:
            f.pop("oracle", None)
    e["class"] = s["class"] = "rounding"
    (run / "summary.json").write_text(json.dumps(s))


def test_the_untouched_run_fails_on_its_bug(moe_bug):
    res = evaluate(str(moe_bug), _rounding())
    assert res.exit_code == EXIT_BUG and not res.problems, res.lines()


@pytest.mark.parametrize("others, strip_pass, words", [
    ("router-flip", False, "no expert choice that differs"),
    ("unknown", False, "the second pass in ops-modules/ judged it 'sharding-bug'"),
    ("unknown", True, "names no second pass"),
], ids=["router-flip-without-a-flip", "against-the-second-pass", "second-pass-deleted"])
def test_a_bug_relabelled_rounding_is_inconclusive(run, tmp_path, others, strip_pass, words):
    _relabel(run, others, strip_pass)
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()
    assert any(words in p for p in res.problems), res.problems
    g = run_cli("gate", str(run), "--allow", "rounding", "--format", "json")
    assert g.returncode == 2, g.stdout[-2000:] + g.stderr[-2000:]
    out = json.loads(g.stdout)
    assert out.get("status") != "pass" and out.get("exit_code", 2) == 2, out
    r = run_cli("report", str(run), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 2 and words in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
