"""Tamper suite, a hash-first run without its region pass (red team hred21). A hash-first capture's
first pass keeps hashes only: its diff.csv rows hold no max abs and no bound, so only the region pass
(region/, its float64 re-execution) judges any record. records/labels.unjudged_problems demanded that
pass behind a rounding label on a FORWARD first divergence only; a backward one - the BUG of
tests/models/planted/backward.py:averaged (the weight grad averaged over the TP ranks where it must be
summed) - relabelled rounding, with region/, the findings and every mention of the pass deleted,
passed `gate --allow rounding` (exit 0). Now inconclusive (exit 2) in any phase.

One real compare at TP=1,2 with --capture hash; each case edits a copy."""
import json
import shutil

import pytest

from conftest import planted_shared, run_cli
from tpdiag.records.causes import EXIT_BUG


@pytest.fixture(scope="module")
def hash_run(tmp_path_factory):
    return planted_shared(tmp_path_factory, "backward", "averaged", "--tp", "1,2", "--capture", "hash")[0]


@pytest.fixture()
def run(hash_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(hash_run, dst)
    for p in dst.rglob("*.json"):  # the region pass is named by absolute path: the copy's own
        t = p.read_text()
        if str(hash_run) in t:
            p.write_text(t.replace(str(hash_run), str(dst)))
    return dst


def test_the_unedited_hash_run_is_a_bug_at_a_backward_record(hash_run):
    s = json.loads((hash_run / "summary.json").read_text())
    fd = s["degrees"]["2"]["first_divergence"]
    assert (fd["phase"], fd["module"], fd["kind"], fd["cause"]) == ("backward", "layer", "param_grad", "sharding-bug"), fd
    p = run_cli("gate", str(hash_run), "--allow", "rounding")
    assert p.returncode == EXIT_BUG, p.stdout + p.stderr


def test_the_region_pass_deleted_with_a_rounding_label_is_inconclusive(run):
    shutil.rmtree(run / "region")
    s = json.loads((run / "summary.json").read_text())
    s.pop("second_pass")
    s["class"] = "rounding"
    d = s["degrees"]["2"]
    for k in ("own_inputs", "unjudged", "own_taps", "not_compared"):
        d.pop(k, None)
    d["findings"], d["class"] = [], "rounding"
    fd = d["first_divergence"]
    for k in ("second_pass_dir", "values_run_dir", "oracle", "bound_model"):
        fd.pop(k, None)
    fd["cause"] = "column-parallel-dgrad"
    (run / "summary.json").write_text(json.dumps(s))
    p = run_cli("gate", str(run), "--allow", "rounding")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "only the second pass's float64 re-execution judges it" in p.stdout, p.stdout
