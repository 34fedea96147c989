"""A bug found INSIDE a module by the op-level second pass is gated as the bug it is.

tests/models/planted/alibi_heads.py, a user's ALiBi model (q/k/v column-parallel, local
tensors): bug() computes the slopes from the local head count, twin() from the global heads at
this rank's offset. The first divergence of bug() is inside `blocks.0.attn` (unprobed code), so
the op-level pass names `aten::mul` (the slopes times the distances) - a record of ops/diff.csv,
not of the run's diff.csv. The gate must read that record as the run's own: exit 4 (a BUG), not
"inconclusive" because the summary's finding is missing from the top-level diff.csv (what it
said before the fix). The twin: 1 by default, 0 with --allow rounding.
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/alibi_heads.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("bug", "twin"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm", "--format", "json",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (d, json.loads(p.stdout))
    return out


def test_the_op_inside_the_module_is_the_bug_and_the_gate_says_so(runs):
    d, s = runs["bug"]
    fd = s["degrees"]["2"]["first_divergence"]
    assert s["class"] == "bug", s["class"]
    assert (fd["module"], fd["op"], fd["cause"]) == ("blocks.0.attn", "aten::mul", "sharding-bug"), fd
    assert (d / "ops" / "diff.csv").is_file()
    g = run_cli("gate", str(d))
    assert g.returncode == 4, g.stdout + g.stderr
    assert "BUG" in g.stdout and "aten::mul" in g.stdout, g.stdout
    assert "INCONCLUSIVE" not in g.stdout, g.stdout


def test_a_tampered_op_record_is_still_inconclusive(runs, tmp_path):
    import shutil

    d, _ = runs["bug"]
    t = tmp_path / "t"
    shutil.copytree(d, t)
    s = json.loads((t / "summary.json").read_text())
    for f in s["degrees"]["2"]["findings"]:
        if "/op#" in f.get("key", ""):
            f["max_abs"] = 1e-30
    (t / "summary.json").write_text(json.dumps(s))
    g = run_cli("gate", str(t))
    assert g.returncode == 2 and "edited after the run" in g.stdout, g.stdout + g.stderr


def test_the_twin_is_rounding(runs):
    d, s = runs["twin"]
    assert s["status"] == "divergent"
    assert run_cli("gate", str(d)).returncode == 1
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 0, g.stdout + g.stderr
