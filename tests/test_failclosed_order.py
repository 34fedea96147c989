"""Fail closed on diff.csv's row fields and order (red teams hred16, hred17). The first divergence is the
first divergent row in diff.csv's order (gate/evidence.check_summary) and a grad is "past the first
divergence" by its idx (diff/not_judged.py); cls lets a router-flip label stand. Each is re-derived with the
other row fields (diff/recheck.check_rows): an idx edited, rows swapped after the first divergence, or a
descriptive field edited, exits 2.
hred17's idx/order check was taken out (df11fce) because it failed honest expert-parallel and hash-capture
runs: their worlds' idx has gaps (rank-local expert records left out at gather), diff.csv keeps those
numbers, and the gate's re-diff renumbered them (RecordSet with drop_kinds renumbered even where it dropped
nothing). It renumbers only where it drops a record now (tests/test_ep_dispatch.py, test_ep_placement.py,
test_rank0_bias.py gate their honest runs with the check on).
"""
import csv

import pytest

from conftest import copied_run, gate_allowing_rounding, planted_shared


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return planted_shared(tmp_path_factory, "grad_hook_plan", "hook_build", "--tp", "1,2")[0]  # test_grad_hook_plan's


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


def test_an_idx_edited_in_diff_csv_is_inconclusive(run):
    assert _gate(run).exit_code not in (0, 2)  # the honest run: a bug (hook_build's dropped clip)
    _rewrite(run / "diff.csv", lambda rows: rows[3].update(idx=str(int(rows[3]["idx"]) + 100)))
    res = _gate(run)
    assert res.exit_code == 2 and "(idx 103 in diff.csv, 3 in the records" in res.problems[0], res.lines()


def test_rows_moved_after_the_first_divergence_are_inconclusive(run):
    """Two divergent rows after the first divergence swapped (each keeps its own fields, idx too): the
    first divergence is unchanged, so check_summary could not see it."""
    def swap(rows):
        div = [i for i, r in enumerate(rows) if r["bitwise"] == "False"]
        i, j = div[2], div[3]
        rows[i], rows[j] = rows[j], rows[i]

    _rewrite(run / "diff.csv", swap)
    res = _gate(run)
    assert res.exit_code == 2 and "in another order than the records give" in res.problems[0], res.lines()


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
