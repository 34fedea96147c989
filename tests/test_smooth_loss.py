"""Label smoothing on a vocab shard, written by hand (tests/models/planted/smooth_loss.py,
smooth_grad.py): the smoothing term's mean over the rank's shard only (ranks disagree on the loss),
the shards' sums averaged instead of summed (the ranks agree, 1/TP of the term), and a one-Function
loss whose own backward takes the smoothing share over the local shard (the loss right, every
logit's grad shifted): each a BUG where it sits, gate 4; the twins rounding, gate 1. Read right
when written (helper hbug12)."""
import pytest

from conftest import compare_planted

CASES = {c: ("smooth_loss", c, ("--tp", "1,2")) for c in ("smooth_local", "smooth_avg", "smooth_ok")}
CASES.update({c: ("smooth_grad", c, ("--tp", "1,2")) for c in ("smooth_grad_local", "smooth_grad_ok")})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


@pytest.mark.parametrize("case,where,said", [
    ("smooth_local", ("loss", "model", "rank-inconsistent-replica"), "loss: the loss function"),
    ("smooth_avg", ("loss", "model", "sharding-bug"), "loss: the loss function"),
    ("smooth_grad_local", ("backward", "head", "sharding-bug"), "backward: head (grad_out 0)"),
])
def test_each_smoothing_mistake_is_a_bug_where_it_sits(runs, case, where, said):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["cause"]) == where and lead["bound_ratio"] > 10, lead
    assert f"BUG (a wrong result, not rounding) at TP=2 {said}" in stdout and gate == 4, stdout


@pytest.mark.parametrize("case", ["smooth_ok", "smooth_grad_ok"])
def test_the_twins_are_rounding(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), (case, s["degrees"]["2"])
    assert "BUG" not in stdout and gate == 1
