"""`tpdiag diff RUN_A/tpN RUN_B/tpM`: one degree of two compare runs, as a user diffs the same run
made on two machines (docs/cross-machine.md). Two separate runs on this CPU stand in for the two
machines: identical runs must diff bitwise, and the diff must still see a real difference."""
import json
import shutil

import pytest
import torch

from conftest import run_cli


@pytest.fixture(scope="module")
def fixed_run(fixall12_run):
    # conftest's session run (no baseline rerun: the diffs below read tp1 and tp2 only); readers
    # only - nothing here writes into it
    return fixall12_run


def _diff(a, b, tmp_path, *extra):
    out = tmp_path / "d"
    p = run_cli("diff", str(a), str(b), "--out", str(out), "--format", "json", *extra)
    return p, (json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None)


def test_same_degree_of_two_runs_is_bitwise(stock_run, tp12_run, tmp_path):
    p, s = _diff(stock_run / "tp2", tp12_run / "tp2", tmp_path, "--fail-on-divergence")
    assert p.returncode == 0, p.stderr + p.stdout
    assert s["status"] == "bitwise" and s["reference"] == 2


def test_diff_sees_a_real_difference(stock_run, tp12_run, tmp_path):
    # negative control for the test above: the stock TP=2 run against the other run's TP=1
    p, s = _diff(stock_run / "tp1", tp12_run / "tp2", tmp_path, "--fail-on-divergence")
    assert p.returncode == 1, p.stderr + p.stdout
    (entry,) = s["degrees"].values()
    assert entry["status"] == "divergent"
    assert entry["first_divergence"]["cause"] == "row-parallel-reduction"


def test_fixed_runs_diff_bitwise_across_degrees(fixed_run, tmp_path):
    p, s = _diff(fixed_run / "tp1", fixed_run / "tp2", tmp_path, "--fail-on-divergence")
    assert p.returncode == 0, p.stderr + p.stdout
    assert s["status"] == "bitwise"


def test_runs_with_other_fixes_are_refused(stock_run, fixed_run, tmp_path):
    p, _ = _diff(stock_run / "tp2", fixed_run / "tp2", tmp_path)
    assert p.returncode == 2
    assert "not comparable: fixes" in p.stderr and p.stderr.count("\n") == 1


def test_tree_groups_are_in_effect_and_another_g_is_refused(fixed_run, tmp_path):
    # fixed_run: --tp 1,2 --fix all, so G = 2 (the largest degree); the same run with G = 8
    out = tmp_path / "g8"
    p = run_cli("compare", "--tp", "1,2", "--fix", "all", "--tree-groups", "8", "--no-confirm",
                "--no-baseline", "--out", str(out), "--format", "json")
    assert p.returncode == 0, p.stderr
    s8 = json.loads(p.stdout)
    assert s8["status"] == "bitwise" and (s8["tree_groups"], s8["group_gemm"]) == (8, "fused")
    s2 = json.loads((fixed_run / "summary.json").read_text())
    assert (s2["tree_groups"], s2["group_gemm"]) == (2, "per-group")
    # G is in effect: TP=1 itself reduces in another tree, so other bits
    from tpdiag.records.store import RecordSet

    a, b = RecordSet(str(fixed_run / "tp1")), RecordSet(str(out / "tp1"))
    differ = [k for k, m in a.by_key.items() if k in b.by_key and not torch.equal(
        a.tensor(m).reshape(-1).view(torch.uint8), b.tensor(b.by_key[k]).reshape(-1).view(torch.uint8))]
    assert len(differ) > 10 and "s0/forward/layers.0.attention.wo/out#0/0" in differ, differ
    p, _ = _diff(fixed_run / "tp1", out / "tp1", tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "not comparable: tree groups: 2 in" in p.stderr and " vs 8 in " in p.stderr, p.stderr


def test_other_seed_is_refused(stock_run, tmp_path):
    copy = tmp_path / "copy" / "tp2"
    shutil.copytree(stock_run / "tp2", copy)
    w = json.loads((copy / "world.json").read_text())
    w["config"]["seed"] += 1
    (copy / "world.json").write_text(json.dumps(w))
    p, _ = _diff(stock_run / "tp2", copy, tmp_path)
    assert p.returncode == 2 and "not comparable: seed" in p.stderr


def test_a_whole_compare_run_names_its_degrees(stock_run, tp12_run, tmp_path):
    p, _ = _diff(stock_run, tp12_run / "tp2", tmp_path)
    assert p.returncode == 2
    assert "name one of its degrees" in p.stderr and str(stock_run / "tp2") in p.stderr
