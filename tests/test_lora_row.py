"""A LoRA adapter on a hand-written row-parallel down projection (tests/models/planted/lora_row.py):
the adapter's output added to the rank's partial sum on every rank after its input was made whole
(TP x the adapter): BUG at the MLP's forward; with peft's zero `lora_b` the forward is right and
the backward's `lora_b` grad is TP x TP=1's: BUG there; the twin (each rank's share of the adapter,
linear in the shard) rounding. Read right when written (helper hbug12)."""
import pytest

from conftest import compare_planted

CASES = {c: ("lora_row", c, ("--tp", "1,2")) for c in ("lora_every_rank", "lora_zero_b", "lora_ok")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


@pytest.mark.parametrize("case,where,said", [
    ("lora_every_rank", ("forward", "mlp", "sharding-bug"), "forward: mlp"),
    ("lora_zero_b", ("backward", "mlp", "sharding-bug"), "backward: mlp (param_grad lora_b)"),
])
def test_the_adapter_added_on_every_rank_is_a_bug_where_it_sits(runs, case, where, said):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["cause"]) == where and lead["bound_ratio"] > 1e4, lead
    assert f"BUG (a wrong result, not rounding) at TP=2 {said}" in stdout and gate == 4, stdout


def test_each_ranks_share_of_the_adapter_is_rounding(runs):
    s, stdout, gate = runs["lora_ok"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1
