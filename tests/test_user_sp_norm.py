"""A user's own Megatron-style sequence-parallel step recorded with `tpdiag.capture` (gloo worlds,
tests/user_sp_norm.py), then `tpdiag diff` / `tpdiag gate` as a user runs them (helper htrial12).

Main at 81c200d read the CORRECT loop a BUG (gate 4, `rank-inconsistent-replica` at `backward: norm
(param_grad weight)`): the capture records each grad where autograd accumulates it, before the
loop's own all-reduce of the sequence-parallel norm weights' grads, so each rank held its half.
Such a partial grad whose parameter is one value on every rank after the step is left uncompared
now (diff/partials.py reduced_after_backward); the loop that forgets the all-reduce still reads
BUG at that grad, saying the ranks' copies add up to the reference."""
import json

import pytest

from conftest import run_cli
from user_worlds import capture_worlds


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("spnorm"), "user_sp_norm", "step",
                          ((1, "none"), (2, "none"), (2, "no_allreduce")))


def _diff(captures, tmp_path, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-none"), str(captures / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text()), p.stdout, run_cli("gate", str(out)).returncode


def test_grads_reduced_by_the_loop_after_the_backward_are_rounding_only(captures, tmp_path):
    s, stdout, gate = _diff(captures, tmp_path, "2-none")
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d["findings"], d["findings"]
    assert "BUG" not in stdout and gate == 1
    # the partial grads left uncompared are said, not silently dropped: summary.json, the CLI, the report
    nc = d["not_compared"]
    assert any("norm" in k and "param_grad" in k for k in nc["module_records"]), nc
    assert nc["why"] and nc["records"] >= len(nc["module_records"])
    assert "not compared (" in stdout, stdout
    from tpdiag.reports.words import verdict

    assert any(f.startswith("Not compared: ") for f in verdict("2", "1", d, lambda c, o: (None, False))["findings"])
    # the norms' grads as recorded are each rank's half: not compared, and said why
    rows = [r for r in open(tmp_path / "2-none" / "diff.csv").read().splitlines()
            if "/param_grad#0/weight" in r and "norm" in r.split(",")[5]]
    assert not rows, rows


def test_a_forgotten_all_reduce_reads_bug_at_the_norm_grad(captures, tmp_path):
    s, stdout, gate = _diff(captures, tmp_path, "2-no_allreduce")
    d = s["degrees"]["2"]
    assert s["class"] == "bug" and gate == 4, stdout
    f = d["findings"][0]
    assert (f["phase"], f["kind"], f["name"], f["cause"]) == ("backward", "param_grad", "weight",
                                                              "rank-inconsistent-replica"), f
    assert f["module"] in ("norm", "mlp_norm") and f.get("partial_sum"), f
    assert "BUG" in stdout and "param_grad weight" in stdout
