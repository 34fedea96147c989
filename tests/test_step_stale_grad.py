"""A mistake only step 1's backward shows, in a grad no check can judge (tests/models/planted/
step_stale_grad.py: the residual grad's memo keyed by shape, dropout in the model's own code so its
float64 backward is refused). Main at cd75311 read it `rounding only` and `gate --allow rounding`
passed (exit 0), by two rules of this session: mlp's output grad was dropped from not_judged as the
namesake of its `reduce` child's grad (judged only by mlp's float64 backward FROM that very grad), and
not_judged's rel_l2 measured the first differing step only. At ac5d9d6 it read `not judged`. Its twin
stays rounding only (without dropout, the model's float64 backward finds the mistake: BUG at mlp's grad)."""
import json

import pytest

from conftest import run_cli, shared_run


def _run(tmp_path_factory, case):
    def make(out):
        p = run_cli("compare", "--model", f"py:tests/models/planted/step_stale_grad.py:{case}", "--tp", "1,2",
                    "--steps", "2", "--no-confirm", "--no-baseline", "--out", str(out), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, f"step-stale-grad-{case}", make)
    g = run_cli("gate", str(out), "--allow", "rounding")
    return json.loads((out / "summary.json").read_text()), g.returncode, g.stdout + g.stderr, out


@pytest.mark.parametrize("case", ["stale_grad_drop", "fresh_grad_drop"])
def test_a_stale_backward_memo_in_an_unjudged_grad_is_not_rounding(tmp_path_factory, case):
    s, gate, out, _ = _run(tmp_path_factory, case)
    nj = s["degrees"]["2"].get("not_judged") or {}
    # the grad the mistake moved is listed, measured at its own step (its forward stayed at rounding)
    assert "s1/backward/mlp/grad_out#0/0" in nj.get("keys", ()), nj
    if case == "fresh_grad_drop":
        assert s["class"] == "rounding" and nj["rel_l2"] < 1e-5, (s["class"], nj)
        assert gate == 0, out
        return
    assert s["class"] == "unknown" and nj["rel_l2"] > 0.1, (s["class"], nj)
    assert gate == 1, out


def test_measured_steps_keep_a_later_step_whose_forward_stayed_at_rounding():
    from tpdiag.diff.measured_steps import measured_steps

    def fwd(i, step, rel):
        return {"idx": i, "step": step, "phase": "forward", "kind": "out", "bitwise": False, "rel_l2": rel,
                "dtype": "float32"}
    # float32 tiny-llama's drift (Adam's sign-like update: 94x the first step's move) is left out
    assert measured_steps([fwd(0, 0, 5.0e-7), fwd(1, 1, 4.7e-5), fwd(2, 2, 1.9e-5)]) == {"0"}
    assert measured_steps([fwd(0, 0, 1.4e-7), fwd(1, 1, 1.5e-7)]) == {"0", "1"}
    # a forward move not measured is no scale: the first step alone
    assert measured_steps([fwd(0, 0, None), fwd(1, 1, 1e-9)]) == {"0"}
    assert measured_steps([fwd(0, 0, 1e-7), fwd(1, 1, None)]) == {"0"}
    # nor is a first step's forward that moved past a few roundings (a near tie flipped: O(1))
    assert measured_steps([fwd(0, 0, 0.3), fwd(1, 1, 0.3)]) == {"0"}


def test_its_not_judged_cut_from_both_summaries_is_inconclusive(tmp_path_factory, tmp_path):
    """The gate's moved-record check (moved_records.cut) read the first divergence's step alone: with the
    list and the class cut from summary.json and ops/summary.json the run passed `gate --allow rounding`,
    exit 0 (docs/security.md named it open). Step 1's forward stayed at rounding, so it is read too."""
    import shutil

    from conftest import json_edit
    from tpdiag.gate import evaluate, load_policy
    from tpdiag.gate.policy import with_allowed

    run = tmp_path / "run"
    shutil.copytree(_run(tmp_path_factory, "stale_grad_drop")[3], run, symlinks=True)

    def rounding(s):
        s["class"] = "rounding"
        for d in s["degrees"].values():
            d["class"] = "rounding"
            d.pop("not_judged", None)
    for f in ("summary.json", "ops/summary.json"):
        json_edit(run / f, rounding)
    res = evaluate(str(run), with_allowed(load_policy(None), "rounding"))
    assert res.exit_code == 2 and "no finding at s1/backward/" in res.problems[0], res.lines()
