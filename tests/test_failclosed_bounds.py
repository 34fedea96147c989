"""Fail closed on a bug whose `beyond_bound` was cleared (red team hred16, left open; closed by hred17).
tests/models/planted/two_paths.py:pair_f (Megatron's f in front of a replicated gate: the block's output
grad 25% off) is a bug only the second pass's float64 re-execution names: ops/diff.csv has the grad beyond
its bound, and both summaries the finding. The oracle's verdict is cross-checked, not re-derived (the gate
does not re-run it), so with beyond_bound cleared in diff.csv and ops/diff.csv and the findings cut from
summary.json and ops/summary.json (and the class), the run passed `gate --allow rounding` on main, exit 0.
Now a degree that names only rounding may have no record from its first divergence on that moved beyond
what rounding moves one (diff/moved_records.cut, from the re-diffed records' rel_l2): exit 2.
"""
import csv
import json
import shutil

import pytest

from conftest import copied_run, gate_allowing_rounding, json_edit, planted_shared
from tpdiag.records.causes import EXIT_BUG

KEYS = {"s0/backward/stage.block/grad_out#0/0", "s0/backward/embed/grad_out#0/0"}


@pytest.fixture(scope="module")
def pair_f(tmp_path_factory):
    return planted_shared(tmp_path_factory, "two_paths", "pair_f", "--tp", "1,2", "--dtype", "float32")[0]  # test_two_paths'


@pytest.fixture()
def run(pair_f, tmp_path):
    return copied_run(pair_f, tmp_path)


_gate = gate_allowing_rounding


def _cut(s):
    s["class"] = "rounding"
    for d in s["degrees"].values():
        d["class"] = "rounding"
        d["findings"] = [f for f in d["findings"] if f.get("key") not in KEYS]


def _clear(path):
    rows = list(csv.DictReader(path.open()))
    for r in rows:
        if r["key"] in KEYS:
            r["beyond_bound"] = ""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_the_honest_run_is_a_bug_judged_by_the_second_pass(pair_f):
    d = json.loads((pair_f / "summary.json").read_text())["degrees"]["2"]
    assert {f["key"] for f in d["findings"]} == KEYS and {f["cause"] for f in d["findings"]} == {"sharding-bug"}, d
    beyond = {r["key"] for r in csv.DictReader((pair_f / "ops" / "diff.csv").open()) if r["beyond_bound"] == "True"}
    assert beyond == KEYS, beyond
    assert _gate(pair_f).exit_code == EXIT_BUG


def test_beyond_bound_cleared_in_both_diff_csv_with_the_findings_cut_is_inconclusive(run):
    for f in ("summary.json", "ops/summary.json"):
        json_edit(run / f, _cut)
    for f in ("diff.csv", "ops/diff.csv"):
        _clear(run / f)
    res = _gate(run)
    assert res.exit_code == 2 and "no finding at s0/backward/stage.block/grad_out#0/0, but that record moved 0.251" \
        in res.problems[0], res.lines()


def test_the_bug_listed_as_shares_in_both_summaries_is_inconclusive(run):
    """not_compared.shares (records a hash-first pass 1 hashed per rank, read whole by the region pass as
    each rank's share of one value) are skipped by the gate, and summary.json's list was only held to the
    second pass's (records/shares.shares_problem): the bug's grads listed there in both summaries, with the
    findings cut, passed `gate --allow rounding` on main, exit 0 (hred17; so did behind.py:bugs' rank-
    inconsistent replica). A share must be a record the re-diff leaves uncompared as the ranks' shares of
one value, or a per-rank hash of a hash-first pass 1: neither here."""
    def shared(s):
        _cut(s)
        for d in s["degrees"].values():
            d.setdefault("not_compared", {})["shares"] = sorted(KEYS)

    for f in ("summary.json", "ops/summary.json"):
        json_edit(run / f, shared)
    res = _gate(run)
    assert res.exit_code == 2 and "not_compared.shares lists s0/backward/embed/grad_out#0/0, which the records show " \
        "neither" in res.problems[0], res.lines()


def test_a_harmless_not_judged_list_written_into_both_summaries_is_inconclusive(run):
    """As above, with a not_judged list of one grad that moved by rounding written into both summaries (its
    rel_l2 the records' own): a check reading only an absent list let it pass (hred17, found on its own fix;
    on main it passed too, exit 0). Grads the list names are the verdict's; the block's is not listed."""
    from tpdiag.diff.moved_limit import rel_l2
    from tpdiag.diff.recheck import recomputed
    from tpdiag.records.store import RecordSet

    harmless = "s0/backward/stage/grad_out#0/1"
    dd, _ = recomputed(RecordSet(str(run / "tp1")), RecordSet(str(run / "tp2"), drop_kinds=("oracle",)), "2",
                       also={harmless})
    rel = rel_l2(dd.tensors[harmless])  # as compare computes it (diff/not_judged.grads)
    assert rel is not None and 0 < rel < 1e-5, rel
    nj = {"records": 1, "why": {"not judged": 1}, "keys": [harmless], "reasons": {harmless: "not judged"},
          "max_rel": 0.0, "rel_l2": rel, "dtype": "float32"}

    def listed(s):
        _cut(s)
        for d in s["degrees"].values():
            d["not_judged"] = nj

    for f in ("summary.json", "ops/summary.json"):
        json_edit(run / f, listed)
    for f in ("diff.csv", "ops/diff.csv"):
        _clear(run / f)
    res = _gate(run)
    assert res.exit_code == 2 and "does not list as not judged and has no finding at s0/backward/stage.block/grad_out" \
        in res.problems[0], res.lines()


def test_the_second_pass_deleted_and_a_bound_written_in_is_inconclusive(run):
    """ops/ and every mention of the second pass deleted, the findings cut, and a rounding bound written for
    the first divergence into diff.csv and summary.json (the bound is cross-checked, not re-derived; without
    one, a rounding label needs the second pass named: records/labels.py). On main this passed `gate --allow
    rounding`, exit 0 (hred17); the block's grad still moved 25%."""
    shutil.rmtree(run / "ops")
    (run / "own-inputs-tp2.safetensors").unlink()
    fd_key = "s0/forward/stage.block/out#0/0"

    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k not in ("second_pass", "second_pass_dir", "oracle",
                                                                    "own_inputs", "own_taps", "bound_model")}
        return [strip(v) for v in o] if isinstance(o, list) else o

    rows = list(csv.DictReader((run / "diff.csv").open()))
    row = next(r for r in rows if r["key"] == fd_key and r["degree"] == "2")
    row.update(bound="0.001", beyond_bound="False")
    with (run / "diff.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    s = strip(json.loads((run / "summary.json").read_text()))
    _cut(s)
    s["degrees"]["2"]["findings"] = []
    s["degrees"]["2"]["first_divergence"].update(bound=0.001, bound_ratio=float(row["max_abs"]) / 0.001)
    (run / "summary.json").write_text(json.dumps(s))
    res = _gate(run)
    assert res.exit_code == 2 and "no finding at s0/backward/stage.block/grad_out#0/0, but that record moved 0.251" \
        in res.problems[0], res.lines()
