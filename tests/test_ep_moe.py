"""A user's expert-parallel MoE (tests/models/ep_moe.py: each rank runs only its experts' tokens,
so the ranks' op streams differ): the second pass falls back to module level (RUN_DIR/ops-modules)
and the gate and report read that genuine run as a run - not as a second pass "not one tpdiag
writes" (exit 2, inconclusive), which they did before records/paths.SECOND_PASS_DIRS named it."""
import json

import pytest

from conftest import run_cli


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "run"
    p = run_cli("compare", "--model", "py:tests/models/ep_moe.py:target", "--tp", "1,2", "--forward-only",
                "--no-confirm", "--no-baseline", "--out", str(out))
    assert p.returncode == 0, p.stderr + p.stdout
    return out


def test_the_module_level_second_pass_is_read_as_the_runs_own(run):
    summary = json.loads((run / "summary.json").read_text())
    assert summary["second_pass"]["dir"].rstrip("/").endswith("ops-modules")
    assert summary["degrees"]["2"]["first_divergence"]["module"] == "moe"
    g = run_cli("gate", str(run), "--allow", "rounding")
    # the cause stays unknown (no op could be recorded): the gate fails closed on it, exit 1 -
    # a judgement of the run, not exit 2's "this run directory is not one tpdiag wrote"
    assert g.returncode == 1, g.stdout + g.stderr
    assert "not one tpdiag writes" not in g.stdout + g.stderr and "cause unknown" in g.stdout
    r = run_cli("report", str(run))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_old_names_read_it_as_inconclusive(run, monkeypatch):
    # negative control: without the '-modules' names the same directory reads as tampered
    from tpdiag.records import integrity

    monkeypatch.setattr(integrity, "SECOND_PASS_DIRS", ("region", "region-all", "ops", "ops-all", "region/ops"))
    summary = json.loads((run / "summary.json").read_text())
    problems = integrity._second_pass_problems(str(run), summary, summary["degrees"])
    assert any("not one tpdiag writes" in p for p in problems), problems
