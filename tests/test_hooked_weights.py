"""Hooked weights under the fixes (tests/models/planted/hooked_weights.py, red team hred15 case 4).
The fixes' fp32 carry leaves a weight the stock grad where the user hooked its grad or computes it
(a parametrization): "with every fix on, bitwise across TP" does not cover it. `--fix all` at TP=1,2:
the hooked w2 (its hook held at TP=1 only: parallelize_module replaced the parameter) reads a
shape-dependent weight grad with invariant-gemm on; the verdict now names the weight and why
(summary.json not_carried) - on the old code nothing said so. The parametrized head got no grad at
all under the carry before (tests/test_carry_user_hooks.py); here the run is bitwise and the weight named."""
import pytest

from conftest import compare_planted

CASES = {c: ("hooked_weights", c, ("--tp", "1,2", "--fix", "all")) for c in ("hooked_grad", "hooked_param", "plain")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_hooked_weight_is_named_where_the_fixes_leave_it_not_bitwise(runs):
    from tpdiag.kernels.grad_carry import HOOKED

    s, stdout, gate = runs["hooked_grad"]
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert s["class"] == "rounding" and (fd["module"], fd["kind"], fd["name"]) == ("w2", "param_grad", "weight"), fd
    assert d["not_carried"] == {"w2.weight": HOOKED}, d.get("not_carried")
    assert "kept the stock grad" in stdout and "w2.weight" in stdout
    what = next(ln for ln in stdout.splitlines() if ln.startswith("what to do:"))
    assert "w2.weight kept the stock grad" in what, what


def test_a_parametrized_weight_is_updated_and_named(runs):
    from tpdiag.kernels.grad_carry import COMPUTED

    s, stdout, gate = runs["hooked_param"]
    d = s["degrees"]["2"]
    assert s["status"] == "bitwise" and d["not_carried"] == {"head.weight": COMPUTED}, d
    assert "kept the stock grad" in stdout


def test_the_plain_twin_is_bitwise_with_nothing_left_out(runs):
    s, stdout, gate = runs["plain"]
    assert s["status"] == "bitwise" and "not_carried" not in s["degrees"]["2"], s["degrees"]["2"]
    assert "stock grad" not in stdout
