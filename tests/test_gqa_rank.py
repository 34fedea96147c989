"""GQA with fewer KV heads than the degree (tests/models/planted/gqa_rank.py): 2 KV heads held whole
on every rank, each rank picking its query heads' KV head. `rank % n_kv` is right at TP=2 and
wrong at TP=4 only (ranks 1 and 2 swap KV heads): BUG at the attention at TP=4, TP=2 rounding; the
twin rounding at both. Read right when written (helper hbug12)."""
import pytest

from conftest import compare_planted

CASES = {c: ("gqa_rank", c, ("--tp", "1,2,4")) for c in ("gqa_rank_mod", "gqa_ok")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_wrong_kv_head_at_tp4_only_is_a_bug_there(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["gqa_rank_mod"]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["4"]
    assert s["degrees"]["2"]["class"] == "rounding" and leading_bug(s["degrees"]["2"]) is None, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["4"])
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "attn", "sharding-bug"), lead
    assert lead["bound_ratio"] > 1e4, lead
    assert "BUG (a wrong result, not rounding) at TP=4 forward: attn" in stdout, stdout


def test_the_twin_is_rounding_at_every_degree(runs):
    s, stdout, gate = runs["gqa_ok"]
    assert s["class"] == "rounding" and gate == 1, s["degrees"]
    for tp in ("2", "4"):
        assert not s["degrees"][tp].get("findings"), (tp, s["degrees"][tp].get("findings"))
    assert "BUG" not in stdout
