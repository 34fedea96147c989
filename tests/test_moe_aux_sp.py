"""A Switch-style balance loss in a sequence-parallel MoE written by hand
(tests/models/planted/moe_aux_sp.py, helper hplant17): the ranks' balance losses averaged (a mean
of products: a BUG at moe.balance), the sums all-reduced by torch's autograd all_reduce (its
backward sums the ranks' grads of one replicated loss: the router's grad_out a BUG, TP times the
term), and the twin. Each rank routes its own tokens, so the ranks' op streams differ and the MoE
layer is judged at module level: near its float64 re-execution, but with no ops and no sharded
matrix to name the reordering, the twin's first divergence read `unknown` and failed
`gate --allow rounding` on main. Its input split on the sequence names it: batch-variant-kernel."""
import json

import pytest

from conftest import planted_run, run_cli

CASES = ("aux_rank_mean", "aux_autograd_sum", "aux_global")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in CASES:
        d, p = planted_run(tmp_path_factory, "moe_aux_sp", case, "--tp", "1,2")
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout,
                     run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


@pytest.mark.parametrize("case,where", [
    ("aux_rank_mean", ("forward", "moe.balance", "out", "sharding-bug")),
    ("aux_autograd_sum", ("backward", "moe.router", "grad_out", "sharding-bug")),
])
def test_each_balance_mistake_is_a_bug_where_it_sits(runs, case, where):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == where, lead
    assert f"BUG (a wrong result, not rounding) at TP=2 {where[0]}: {where[1]}" in stdout and gate == 4, stdout


def test_the_twin_is_rounding_named_by_its_split_rows(runs):
    s, stdout, gate = runs["aux_global"]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("findings"), e
    fd = e["first_divergence"]
    assert (fd["module"], fd["cause"]) == ("moe", "batch-variant-kernel") and not fd["oracle"]["far"], fd
    assert "BUG" not in stdout and gate == 0, stdout
