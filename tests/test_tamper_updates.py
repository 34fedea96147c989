"""Tamper suite, a capture's optimizer update (red team hred13): a record one factor times the reference's
is a bug finding however summary.json is edited.

One `tpdiag diff` of two captures of tests/user_opt_shard.py (a hand-written AdamW, TP=1 against TP=2 with
`lr_world`: the TP ranks counted as data-parallel replicas, every update 2x). Its BUG is named only by
diff/scale.py - the params after the step are within no bound and beyond none (a user's optimizer has no
bound); their UPDATE is 2x the reference's - and diff.csv has no column for that factor. On 170f498 the
findings deleted from summary.json (or relabelled rounding under the first divergence) passed
`gate --allow rounding` (exit 0): integrity demanded a finding only for a row beyond its bound or
inconsistent across ranks. The gate's re-diff now re-derives the factor and demands its finding
(diff/recheck.check_scaled): inconclusive (exit 2). So did the findings relabelled `unknown` under a
rounding finding written in on a record within its bound (a root locate never makes:
records/labels.made_problems).
"""
import json
import shutil

import pytest
from conftest import run_cli
from user_worlds import capture_worlds

from tpdiag.gate import evaluate, load_policy, with_allowed
from tpdiag.records.causes import EXIT_BUG

LEAD = "s0/optimizer/embed/param#0/weight"


@pytest.fixture(scope="module")
def lr_world(tmp_path_factory):
    base = tmp_path_factory.mktemp("upd")
    capture_worlds(base, "user_opt_shard", "steps", ((1, "none"), (2, "lr_world")))
    out = base / "diff"
    p = run_cli("diff", str(base / "1-none"), str(base / "2-lr_world"), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.fixture()
def run(lr_world, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(lr_world, dst, symlinks=True)
    return dst


def _rounding():
    return with_allowed(load_policy(None), "rounding")


def _edit(run, fn):
    s = json.loads((run / "summary.json").read_text())
    fn(s["degrees"]["2"])
    s["degrees"]["2"]["class"] = s["class"] = "rounding"
    (run / "summary.json").write_text(json.dumps(s))


def test_the_untouched_diff_fails_on_its_bug(lr_world):
    res = evaluate(str(lr_world), _rounding())
    assert res.exit_code == EXIT_BUG and not res.problems, res.lines()
    lead = json.loads((lr_world / "summary.json").read_text())["degrees"]["2"]["findings"][0]
    assert lead["key"] == LEAD and lead["why"].startswith("its update (this step's change of the parameter) is 2x")


def _drop(d):
    d["findings"] = []


def _relabel(d):
    # every finding grouped under the (rounding) first divergence - a follower is never judged on its
    # own - labelled rounding, or `unknown` where diff.csv has the record beyond its bound (a rounding
    # label there is refused by integrity already)
    beyond = "s0/optimizer/down/param#0/bias"
    for f in d["findings"]:
        f.update(cause="unknown" if f["key"] == beyond else "row-parallel-reduction",
                 follows=d["first_divergence"]["key"])


def _fake_root(run):
    """A rounding finding written in on a record diff.csv has divergent but within its bound (none of
    locate's), every real finding `unknown` and grouped under it: the roots' class reads rounding."""
    import csv

    rows = [r for r in csv.DictReader((run / "diff.csv").open()) if r["degree"] == "2"]
    s = json.loads((run / "summary.json").read_text())
    d = s["degrees"]["2"]
    taken = {f["key"] for f in d["findings"]} | {d["first_divergence"]["key"]}
    r = next(r for r in reversed(rows) if r["bitwise"] == "False" and r["beyond_bound"] != "True"
             and r["rank_consistent"] != "False" and r["key"] not in taken)
    for f in d["findings"]:
        f.update(cause="unknown", follows=r["key"])
        f.pop("why", None)
    d["findings"].insert(0, {"phase": r["phase"], "module": r["module"], "op": None, "kind": r["kind"],
                             "name": r["name"], "step": int(r["step"]), "key": r["key"], "idx": int(r["idx"]),
                             "cause": d["first_divergence"]["cause"], "max_abs": float(r["max_abs"])})
    d["class"] = s["class"] = "rounding"
    (run / "summary.json").write_text(json.dumps(s))
    return r["key"]


@pytest.mark.parametrize("edit", [_drop, _relabel, None], ids=["findings-deleted", "relabelled-rounding",
                                                              "unknown-under-a-written-in-root"])
def test_an_update_finding_edited_away_is_inconclusive(run, tmp_path, edit):
    if edit is None:
        key = _fake_root(run)
        words = (key, "not a record tpdiag makes a finding")
    else:
        _edit(run, edit)
        words = (LEAD, "2x the reference's")
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()
    assert any(all(w in p for w in words) for p in res.problems), res.problems
    g = run_cli("gate", str(run), "--allow", "rounding", "--format", "json")
    assert g.returncode == 2 and json.loads(g.stdout)["status"] != "pass", g.stdout[-2000:] + g.stderr[-2000:]
    r = run_cli("report", str(run), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 2 and "inconclusive" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
