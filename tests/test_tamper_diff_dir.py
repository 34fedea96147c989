"""Tamper suite, a `tpdiag diff` directory (red team hred21): a bug verdict that a later pass overrode
keeps locate's label as `cause_before`, and diff/overrides.py holds each such override to that pass's
own files (a confirmation's rerun, the second pass's own-input rows, the grad norm's TP=1 rule). The
gate, `report` and `tpdiag.load` ran that check on compare's run directories only: in a `tpdiag diff`
directory - where no confirmation or second pass runs - every bug finding given `cause_before` under a
rounding label passed `gate --allow rounding` (exit 0).

The captures: tests/user_accum.py (a user's own TP step with grad accumulation, `tpdiag.capture` in
gloo worlds), correct at TP=1 and with its micro-batch count computed over the TP ranks at TP=2
(`accum_tp`: every grad twice TP=1's, a sharding-bug), diffed as a user runs it."""
import json

import pytest

from conftest import run_cli
from tpdiag.records.causes import EXIT_BUG, cause_class
from user_worlds import capture_worlds


@pytest.fixture(scope="module")
def diffed(tmp_path_factory):
    base = capture_worlds(tmp_path_factory.mktemp("accum_dd"), "user_accum", "step", ((1, "none"), (2, "accum_tp")))
    out = base / "diff"
    p = run_cli("diff", str(base / "1-none"), str(base / "2-accum_tp"), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.fixture()
def run(diffed, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(diffed, dst)  # the captures stay where the manifest names them (by absolute path)
    return dst


def test_the_unedited_diff_is_a_bug(diffed):
    p = run_cli("gate", str(diffed), "--allow", "rounding")
    assert p.returncode == EXIT_BUG, p.stdout + p.stderr


def test_a_bug_relabelled_with_cause_before_in_a_diff_directory_is_inconclusive(run):
    s = json.loads((run / "summary.json").read_text())
    d = s["degrees"]["2"]
    bugs = [f for f in d["findings"] if cause_class(f["cause"]) == "bug"]
    assert bugs, d["findings"]
    for f in bugs:
        f["cause_before"], f["cause"] = f["cause"], "row-parallel-reduction"
    d["class"] = "rounding"
    (run / "summary.json").write_text(json.dumps(s))
    p = run_cli("gate", str(run), "--allow", "rounding")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "which the run's own files do not support" in p.stdout, p.stdout
    p = run_cli("report", str(run), "-o", str(run.parent / "r.html"))
    assert p.returncode == 2, p.stdout + p.stderr
