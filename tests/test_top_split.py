"""A top-level module's per-rank shares under `--capture hash` get their caller's op scope (helper
hbug15; tests/models/planted/top_split.py, runner/drill._callers).

Megatron's split row layer (`reduce_results=False`) and its `ReduceFromTP` called by the model's own
forward: `down`'s output differs across ranks by design (each rank's partial sum), so a hash-only
first pass finds it first (rank-inconsistent by hash). The region pass reads it whole as shares a
module reduces and records the caller's ops to name that reduction - where the module's name had a
`.` (mega_split.py's `mlp.down`: caller `mlp`). A top-level `down` got no op scope at all: at b050bc5
top_ok read "not judged (cause unknown)", gate 1. Its caller is the root (scope "model") and the
reducing module a sibling: now `row-parallel-reduction` at `reduce :: c10d::allreduce_`, rounding,
gate 0; the reduce forgotten (top_noreduce) stays a BUG, gate 4.
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/top_split.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("top_ok", "top_noreduce"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--capture", "hash", "--no-baseline",
                    "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), d)
    return out


def test_a_top_level_partial_names_its_reduction_under_hash_capture(runs):
    s, d = runs["top_ok"]
    fd = s["degrees"]["2"]["first_divergence"]
    assert s["class"] == "rounding", (s["class"], fd)
    assert fd["cause"] == "row-parallel-reduction" and fd["module"] == "reduce", fd
    assert fd["op"] == "c10d::allreduce_", fd
    assert "model" in s["second_pass"]["scopes"], s["second_pass"]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_the_reduce_forgotten_at_the_top_level_is_a_bug(runs):
    s, d = runs["top_noreduce"]
    assert s["class"] == "bug", s["degrees"]["2"]["first_divergence"]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4
