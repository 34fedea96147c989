"""Fail closed, red team hred10: the reference rerun (the baseline) cannot be hidden.

The reference rerun decides whether anything may be blamed on TP at all: one that failed, or did not
reproduce the reference, makes the run inconclusive (diff/analyse.py). Its account could be removed:
summary.json's baseline and manifest.json's rerun world dropped (tp1-base/ deleted) with the status made
divergent, a failed rerun's `reproducible: null` kept under a divergent status, the baseline's label
removed (its records then never re-read), or its world said failed under a "reproducible" verdict - each
passed `gate --allow rounding` (exit 0) on the code before. Now a compare configured with a rerun reports
it, a rerun that failed or did not reproduce leaves the run inconclusive, and a reproducible verdict
names a rerun world that finished.

Edits are made to copies of conftest's session run tp12_run (tiny-llama at TP=1,2, its rerun tp1-base).
"""
import json
import shutil

import pytest

from tpdiag.errors import Inconclusive
from tpdiag.gate import evaluate, load_policy, with_allowed


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture()
def tp12(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    assert json.loads((dst / "summary.json").read_text())["baseline"] == {"reproducible": True, "label": "1-base"}
    return dst


def _edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _hidden(r):
    _edit(r / "summary.json", lambda s: s.pop("baseline"))
    _edit(r / "manifest.json", lambda m: m["worlds"].pop("1-base"))
    shutil.rmtree(r / "tp1-base")


def _failed_kept_divergent(r):
    # what a rerun that failed leaves, but for the status (inconclusive) made divergent again
    _edit(r / "summary.json", lambda s: s.update(baseline={"reproducible": None, "label": "1-base", "error": "x"}))
    _edit(r / "manifest.json", lambda m: m["worlds"]["1-base"].update(status="failed", error="x"))
    shutil.rmtree(r / "tp1-base")


EDITS = {
    "the rerun hidden": (_hidden, "ran a reference rerun (baseline true) but summary.json reports no baseline"),
    "a failed rerun under a divergent status": (_failed_kept_divergent, "failed, but the run's status is 'divergent'"),
    "the rerun's label removed": (lambda r: _edit(r / "summary.json", lambda s: s["baseline"].pop("label")),
                                  "baseline names no reference rerun"),
    "the rerun's world failed": (lambda r: _edit(r / "manifest.json",
                                                 lambda m: m["worlds"]["1-base"].update(status="failed", error="x")),
                                 "reproduced the reference but manifest.json says its world failed"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_hidden_or_contradicted_baseline_is_inconclusive(tp12, case):
    import tpdiag

    edit, words = EDITS[case]
    edit(tp12)
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    assert any(words in p for p in res.problems), (case, res.problems)
    with pytest.raises(Inconclusive, match="evidence disagrees"):
        tpdiag.load(str(tp12))


def test_a_run_without_a_rerun_asked_passes(tp12):
    """The control: a compare run with --no-baseline has no baseline to report."""
    _hidden(tp12)
    _edit(tp12 / "manifest.json", lambda m: m["config"].update(baseline=False))
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 0, res.lines()
