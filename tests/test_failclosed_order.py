"""Fail closed on diff.csv's descriptive row fields (red team hred17): cls, style, layout and shape are
re-derived with the other row fields (diff/recheck.check_rows). diff.csv's idx and row order are NOT
re-derived (still open, docs/security.md): hred17's check of them (idx equal to the re-diff's, rows in
its order) failed honest runs - hash-capture and expert-parallel runs write diff.csv's rows in another
numbering than the re-diff's (tests/test_ep_dispatch.py, test_rank0_bias.py, test_ep_placement.py
read exit 2, "edited after the run"), so it was taken out.
"""
import csv

import pytest

from conftest import copied_run, gate_allowing_rounding, planted_run


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return planted_run(tmp_path_factory, "grad_hook_plan", "hook_build", "--tp", "1,2", name="order")[0]


@pytest.fixture()
def run(built, tmp_path):
    return copied_run(built, tmp_path)


def _rewrite(path, fn):
    rows = list(csv.DictReader(path.open()))
    fn(rows)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)


_gate = gate_allowing_rounding


@pytest.mark.parametrize("field,value", [("cls", "TopkRouter"), ("style", "rowwise"), ("layout", "shard:1"),
                                         ("shape", "32x64")])
def test_a_descriptive_field_edited_in_diff_csv_is_inconclusive(run, field, value):
    """cls, style, layout and shape were not re-derived either (red team hred17): cls is what lets a
    router-flip label stand on an integer record (records/labels.is_router), and a router flip switches
    off the not-judged limit. On main each edit went unseen (the honest bug verdict, exit 4)."""
    key = "s0/backward/w1/param_grad#0/weight"
    _rewrite(run / "diff.csv", lambda rows: next(r for r in rows if r["key"] == key).update({field: value}))
    res = _gate(run)
    assert res.exit_code == 2 and f"record {key} does not match diff.csv ({field} '{value}' in diff.csv" \
        in res.problems[0], res.lines()
