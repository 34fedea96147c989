"""Fail closed on summary.json's not_judged (red team hred16): the activation grads past the first
divergence no check judged, which the gate fails as cause unknown where they moved beyond rounding
(gate/degree.py, diff/moved_limit.moved_beyond). tests/models/planted/two_paths.py:pair_drop_f (its
block's grad 27% off; dropout refuses the float64 backward that would judge it) exits 1 under
`gate --allow rounding`. On main it passed, exit 0, with not_judged cut from summary.json alone (the
second pass's ops/summary.json still listing it), or with its rel_l2 edited to 1e-9 in both summaries.
Now summary.json's not_judged must be the second pass's (records/integrity.not_judged_problem) and its
rel_l2 what the listed grads' records give (diff/recheck.moved_problem), and diff.csv's dtype (the limit's
unit) is re-derived: each exits 2.
"""
import json

import pytest

from conftest import copied_run, gate_allowing_rounding, json_edit, planted_run


@pytest.fixture(scope="module")
def drop(tmp_path_factory):
    return planted_run(tmp_path_factory, "two_paths", "pair_drop_f", "--tp", "1,2", name="nj")[0]


@pytest.fixture()
def run(drop, tmp_path):
    return copied_run(drop, tmp_path)


_edit = json_edit


def _rounding(s):
    s["class"] = "rounding"
    for d in s["degrees"].values():
        d["class"] = "rounding"


_gate = gate_allowing_rounding


def test_the_honest_run_fails_as_not_judged(drop):
    nj = json.loads((drop / "summary.json").read_text())["degrees"]["2"]["not_judged"]
    assert nj["rel_l2"] > 0.2 and nj["records"] == len(nj["keys"]), nj
    res = _gate(drop)
    assert res.exit_code == 1 and "not judged (summary.json not_judged)" in res.lines()[0], res.lines()


def test_not_judged_cut_from_summary_json_is_inconclusive(run):
    _edit(run / "summary.json", lambda s: (_rounding(s), s["degrees"]["2"].pop("not_judged")))
    res = _gate(run)
    assert res.exit_code == 2 and "not_judged is not the second pass's" in res.problems[0], res.lines()


def test_rel_l2_edited_in_both_summaries_is_inconclusive(run):
    for f in ("summary.json", "ops/summary.json"):
        _edit(run / f, lambda s: (_rounding(s), s["degrees"]["2"]["not_judged"].update(rel_l2=1e-9)))
    res = _gate(run)
    assert res.exit_code == 2 and "not_judged.rel_l2 is 1e-09 but its listed grads' records moved" in res.problems[0], \
        res.lines()


def test_the_listed_grads_dtype_edited_in_diff_csv_is_inconclusive(run):
    """The limit is 1000 eps of the listed grads' dtype as diff.csv says it (float32: 1.2e-4 of the norm);
    edited to bfloat16 it was 0.2 - a float32 grad no check judged could move 19% and pass. On main this
    run still exits 1 (it moved 27%), so the edit went unseen; now diff.csv's dtype is re-derived."""
    import csv

    keys = set(json.loads((run / "summary.json").read_text())["degrees"]["2"]["not_judged"]["keys"])
    path = run / "diff.csv"
    rows = list(csv.DictReader(path.open()))
    for r in rows:
        if r["key"] in keys:
            r["dtype"] = "bfloat16"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    res = _gate(run)
    assert res.exit_code == 2 and "(dtype 'bfloat16' in diff.csv, 'float32' in the records" in res.problems[0], \
        res.lines()


def test_not_judged_cut_from_both_summaries_is_inconclusive(run):
    """Cut from summary.json and ops/summary.json together, with the class: the check against the second
    pass's list had nothing to compare. On main this passed `gate --allow rounding`, exit 0 (red team
    hred16); now a grad past the first divergence that moved beyond rounding with no finding and no word
    is a list cut (diff/moved_records.cut, re-derived from the records)."""
    for f in ("summary.json", "ops/summary.json"):
        _edit(run / f, lambda s: (_rounding(s), s["degrees"]["2"].pop("not_judged")))
    res = _gate(run)
    words = "does not list as not judged and has no finding at s0/backward/stage.block/grad_out#0/0"
    assert res.exit_code == 2 and words in res.problems[0], res.lines()
