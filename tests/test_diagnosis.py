"""Precise diagnosis on planted cases: a sharding bug behind a reordering, run-to-run noise,
probes that would change numerics, multi-step drift."""
import json

import pytest

from conftest import run_cli


def compare(tmp_path, *args, env=None, code=0):
    p = run_cli("compare", "--out", str(tmp_path / "r"), "--format", "json", "--no-confirm", *args, env=env)
    assert p.returncode == code, p.stderr
    return json.loads(p.stdout)


def test_sharding_bug_downstream_of_a_reordering_is_a_finding(tmp_path):
    s = compare(tmp_path, "--model", "py:tests/models/buggy.py:target", "--tp", "1,2", "--no-baseline")
    d = s["degrees"]["2"]
    # the first divergence is the harmless layer-0 reordering ...
    assert d["first_divergence"]["cause"] == "row-parallel-reduction"
    assert d["first_divergence"]["module"].startswith("layers.0.")
    # ... and the real bug is still named, with its bound
    # root findings: the model's own output carries w2's wrong result ("follows" it)
    bugs = [f for f in d["findings"] if f["cause"] == "sharding-bug" and "follows" not in f]
    assert [f["module"] for f in bugs] == ["layers.1.feed_forward.w2"], d["findings"]
    assert bugs[0]["bound_ratio"] > 10  # |diff| / bound at the worst element


def test_nondeterministic_reference_is_reported_before_blaming_tp(tmp_path):
    s = compare(tmp_path, "--model", "py:tests/models/nondeterministic.py:target", "--tp", "1,2", code=2)
    assert s["status"] == "inconclusive"
    assert s["baseline"]["reproducible"] is False
    assert s["baseline"]["first_divergence"]["module"] == "layers.0.ffn_norm"
    assert "does not reproduce itself" in s["error"]


def test_stock_baseline_is_reproducible_and_probes_do_not_change_numerics(stock_run):
    s = json.loads((stock_run / "summary.json").read_text())
    assert s["baseline"]["reproducible"] is True
    for label in ("1", "1-base", "2", "4", "8"):
        w = json.loads((stock_run / f"tp{label}" / "world.json").read_text())
        assert w["probe_selfcheck"]["equal"] is True and w["probe_selfcheck"]["checked"] > 20


def test_probe_that_changes_numerics_makes_the_run_inconclusive(tmp_path):
    s = compare(tmp_path, "--tp", "1,2", "--no-baseline", code=2,
                env={"TPDIAG_TEST_PERTURB_PROBE": "layers.0.attention.wq"})
    assert s["status"] == "inconclusive"
    assert "the probes changed its numerics" in s["degrees"]["2"]["error"]


def test_steps_report_drift_and_fixes_hold_for_every_step(tmp_path):
    # the steps' drift and the fixes' control: no own-input judgement past the first divergence
    # (a second pass of 3 steps in both worlds)
    s = compare(tmp_path, "--tp", "1,2", "--steps", "3", "--no-baseline", "--no-judge-downstream")
    d = s["degrees"]["2"]
    assert [x["step"] for x in d["steps"]] == [0, 1, 2] and d["first_divergent_step"] == 0
    assert d["steps"][2]["loss"] != d["steps"][2]["loss_reference"]
    s = compare(tmp_path, "--tp", "1,2", "--steps", "3", "--fix", "all", "--no-baseline")
    d = s["degrees"]["2"]
    assert s["status"] == "bitwise" and d["first_divergent_step"] is None
    assert all(x["bitwise"] and x["loss"] == x["loss_reference"] for x in d["steps"])
    # with G = the largest degree (2): one group per rank at TP=2; every record - forward,
    # logprobs, loss, grads, params after each step - bitwise (the stock run above diverges)
    assert (s["tree_groups"], s["group_gemm"]) == (2, "per-group")
    assert d["n_divergent"] == 0 and d["n_records"] > 150


def test_wrong_loss_at_tp2_is_a_sharding_bug_not_a_reordering(tmp_path):
    s = compare(tmp_path, "--model", "py:tests/models/loss_bug.py:target", "--tp", "1,2", "--no-baseline")
    d = s["degrees"]["2"]
    bugs = [f for f in d["findings"] if f["kind"] == "loss"]
    assert bugs and bugs[0]["cause"] == "sharding-bug", d["findings"]
    assert abs(d["loss"]["abs_diff"] - 0.6931471805599453) < 1e-5  # log(2)
    # the logprobs themselves are only reordered: within their bound, not a finding
    assert not [f for f in d["findings"] if f["kind"] == "logprobs"]


def test_stock_logprob_and_grad_norm_differences_are_within_their_bounds(stock_run):
    s = json.loads((stock_run / "summary.json").read_text())
    assert all(d["findings"] == [] for d in s["degrees"].values())


def test_rank_inconsistent_replica_points_at_the_module(tmp_path):
    # the row-parallel reductions fixed, so the planted noise is the first thing to differ on any
    # machine (where the CPU's all-reduce order happens to match TP=1's, it is without the fix)
    s = compare(tmp_path, "--model", "py:tests/models/rank_noise.py:target", "--tp", "1,2",
                "--fix", "tp-invariant-linear")
    assert s["baseline"]["reproducible"] is True  # deterministic per rank, so not noise
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["module"] == "layers.0.ffn_norm" and fd["cause"] == "rank-inconsistent-replica", fd
    f = [x for x in d["findings"] if x["cause"] == "rank-inconsistent-replica"]
    assert f and f[0]["module"] == "layers.0.ffn_norm" and f[0]["max_abs"] > 1e-4


@pytest.fixture(scope="module")
def same_degree_pair(tmp_path_factory):
    """ONE `--tp 1,1` op-granularity compare of a model whose backward is run-to-run noise: read
    by the compare test and diffed (its two TP=1 worlds) by the diff test below."""
    base = tmp_path_factory.mktemp("pair")
    s = compare(base, "--model", "py:tests/models/nondeterministic_bwd.py:target", "--tp", "1,1",
                "--granularity", "op")
    return base, s


def test_same_degree_pair_names_a_nondeterministic_backward_at_its_op(same_degree_pair):
    """`--tp 1,1` on one device is a reproducibility check: a backward whose noise changes run
    to run (as fused attention backwards with atomics do) is named nondeterministic-kernel at
    the op that made it - not a TP cause read from the layout (before: column-parallel-dgrad
    style guesses for a world that has no TP at all)."""
    tmp_path, s = same_degree_pair
    assert s["status"] == "divergent"  # a finding: both worlds were probed, the step varies
    d = s["degrees"]["1-2"]
    assert d["status"] == "divergent" and d["reproducible"] is False
    fd = d["first_divergence"]
    assert (fd["phase"], fd["module"], fd["cause"], fd["op"]) == (
        "backward", "layers.0.attention.wq", "nondeterministic-kernel", "aten::randn"), fd
    assert "does not reproduce the reference at the same TP=1" in d["note"] and "error" not in d
    # the probed and unprobed steps of the reference differ too: the self-check's failure is
    # explained by the same noise, so the pair is a finding and not "failed"
    w = json.loads((tmp_path / "r" / "tp1" / "world.json").read_text())
    assert w["probe_selfcheck"]["equal"] is False
    # the gate judges it (fail: nothing may diverge by default), not "inconclusive" because the
    # first divergent row of diff.csv is the op recorded before the module record
    g = run_cli("gate", str(tmp_path / "r"))
    assert g.returncode == 1 and g.stdout.startswith("gate: FAIL"), g.stdout + g.stderr


def test_diff_of_the_same_setup_twice_names_run_to_run_noise(same_degree_pair, tmp_path):
    """`tpdiag diff` of two same-degree worlds made by one setup (device, backend, versions,
    env): a difference is nondeterminism at its op, as in compare - not a layout cause."""
    pair = same_degree_pair[0] / "r"  # the shared compare's worlds; only copies are edited
    p = run_cli("diff", str(pair / "tp1"), str(pair / "tp1-2"), "--format", "json",
                "--out", str(tmp_path / "d"))
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    (d,) = s["degrees"].values()
    fd = d["first_divergence"]
    assert (fd["module"], fd["cause"], fd["op"]) == ("layers.0.attention.wq", "nondeterministic-kernel", "aten::randn"), fd
    assert d["reproducible"] is False
    # the same pair said to come from another machine: no longer one setup run twice, so the
    # difference stays a located divergence (it may be the machine)
    import shutil

    shutil.copytree(pair, tmp_path / "other")
    m = json.loads((tmp_path / "other" / "manifest.json").read_text())
    m["device"]["host"] = "another-host"
    (tmp_path / "other" / "manifest.json").write_text(json.dumps(m))
    p = run_cli("diff", str(pair / "tp1"), str(tmp_path / "other" / "tp1-2"), "--format", "json",
                "--out", str(tmp_path / "d2"))
    assert p.returncode == 0, p.stderr
    (d,) = json.loads(p.stdout)["degrees"].values()
    assert d["first_divergence"]["cause"] != "nondeterministic-kernel" and "reproducible" not in d


def test_op_search_stays_inside_the_parents_backward():
    """_earlier_op: from wq's grad_out back past its siblings' records to the attention kernel's
    op; never past the parent's own record into another module's backward ops."""
    from tpdiag.diff.first_op import _earlier_op

    def rec(module, kind, bitwise=True):
        return {"step": 0, "phase": "backward", "module": module, "kind": kind, "bitwise": bitwise}

    def op(bitwise):
        return rec("backward", "op", bitwise)

    a = "layers.0.attention"
    rows = [op(False),                                   # layers.0.ffn_norm's backward op
            rec("layers.0.ffn_norm", "grad_out"), rec(a, "grad_out"), rec(a + ".wo", "grad_out"), op(True),
            rec(a + ".wo", "param_grad"), op(False),     # the attention kernel's dq
            op(False), rec(a + ".wv", "grad_out"), rec(a + ".wk", "grad_out"), rec(a + ".wk", "param_grad"),
            rec(a + ".wq", "grad_out", False)]
    first = rows[-1]
    assert _earlier_op(rows, len(rows) - 2, first) is rows[6]
    rows[6]["bitwise"] = rows[7]["bitwise"] = True  # only the op before the parent's record differs
    assert _earlier_op(rows, len(rows) - 2, first) is None


def test_a_rerun_among_other_degrees_that_differs_is_a_failed_baseline(tmp_path):
    """`--tp 1,2,1`: the third world reruns the reference's degree; when it does not reproduce
    the reference, TP=2's difference cannot be blamed on TP - inconclusive, as for the automatic
    reference rerun."""
    s = compare(tmp_path, "--model", "py:tests/models/nondeterministic_bwd.py:target", "--tp", "1,2,1",
                "--no-baseline", code=2)
    assert s["status"] == "inconclusive"
    assert s["degrees"]["1-2"]["reproducible"] is False
    assert "does not reproduce itself (world 1-2: nondeterministic-kernel)" in s["error"]
