"""A user's own optimizer in a captured TP loop (tests/user_opt_shard.py: a hand-written AdamW over a
DTensor plan, two steps, gloo worlds), then `tpdiag diff` and `tpdiag gate` as a user runs them.

Main at 0428e29 read both mistakes `rounding only` (gate 1): `lr_local_shape` (a Muon-style
sqrt(rows / cols) lr scale read from the LOCAL shard: up's update 0.707x TP=1's) and `lr_world` (the
linear scaling rule with the TP ranks counted as replicas: every update 2x). Their first divergence
is a harmless row-parallel reduction; the params after the step differ by far more than rounding,
but no bound covers a user's optimizer and the new values are not one factor times the reference's
(the old value dominates). The UPDATE (new - old) is: diff/scale.Updates judges it by one factor.
The correct twin is `not judged`: a hand-written optimizer's step has no bound (diff/optim_step.py)."""
import json

import pytest

from conftest import run_cli
from user_worlds import capture_worlds


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("opt"), "user_opt_shard", "steps",
                          ((1, "none"), (2, "none"), (2, "lr_local_shape"), (2, "lr_world")))


def _diff(captures, tmp_path, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-none"), str(captures / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    r = run_cli("report", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    return (json.loads((out / "summary.json").read_text()), p.stdout, run_cli("gate", str(out)).returncode,
            (out / "report.html").read_text())


def test_the_correct_hand_written_optimizer_is_not_judged(captures, tmp_path):
    """The hand-written AdamW is no torch.optim optimizer: the capture sees no step to re-run, so nothing
    bounds the parameters after it (diff/optim_step.py) - each one that moved apart is `unknown`, with what
    to do, and the gate fails it even with --allow rounding. Main at cc6fdab read it rounding only (gate 0
    with --allow rounding), as it would read a mistake in the update that no one factor shows."""
    s, stdout, gate, _ = _diff(captures, tmp_path, "2-none")
    d = s["degrees"]["2"]
    assert s["class"] == "unknown", d["findings"]
    # the params did move apart (by the grads' rounding): each is a finding, none a BUG
    assert not d["steps"][0]["bitwise"] and d["steps"][1]["param_max_abs"] > 0, d["steps"]
    opt = [f for f in d["findings"] if f.get("optimizer_step")]
    assert len(opt) == len(d["findings"]) and {f["cause"] for f in opt} == {"unknown"}, d["findings"]
    assert {f["step"] for f in opt} == {0, 1}, opt
    assert "saw no torch.optim optimizer step it" in opt[0]["why"] and "cap.grad_norm" in opt[0]["why"], opt[0]
    assert "not judged at optimizer" in stdout and "BUG" not in stdout, stdout
    assert gate == 1 and run_cli("gate", str(tmp_path / "2-none"), "--allow", "rounding").returncode == 1


@pytest.mark.parametrize("bug,module,factor", [("lr_local_shape", "up", 2 ** -0.5), ("lr_world", "embed", 2.0)])
def test_an_update_scaled_at_tp2_is_a_bug(captures, tmp_path, bug, module, factor):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate, report = _diff(captures, tmp_path, f"2-{bug}")
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["step"], lead["phase"], lead["module"], lead["kind"], lead["name"], lead["cause"]) == \
        (0, "optimizer", module, "param", "weight", "sharding-bug"), lead
    said = f"its update (this step's change of the parameter) is {factor:.4g}x the reference's"
    assert lead["why"].startswith(said), lead["why"]
    assert f"BUG (a wrong result, not rounding) at TP=2 optimizer: {module} (param weight)" in stdout, stdout
    assert gate == 4
    # the report says what the CLI says: the bug, its reason, and no "harmless" advice for it
    assert "computes a wrong result" in report and said in report.replace("&#39;", "'"), report[-3000:]
    assert "Rounding, not a bug" not in report
