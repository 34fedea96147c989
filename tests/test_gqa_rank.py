"""GQA with fewer KV heads than the degree (tests/models/planted/gqa_rank.py): 2 KV heads held whole
on every rank, each rank picking its query heads' KV head. `rank % n_kv` is right at TP=2 and
wrong at TP=4 only (ranks 1 and 2 swap KV heads): BUG at the attention at TP=4, TP=2 rounding; the
twin rounding at both. The same after a correct block in bf16 (the mistake's inputs already differ
by rounding). Read right when written (helper hbug12)."""
import pytest

from conftest import compare_planted

CASES = {"gqa_rank_mod": ("gqa_rank", "gqa_rank_mod", ("--tp", "1,2,4"))}
CASES.update({c: ("gqa_rank", c, ("--tp", "1,2,4", "--dtype", "bfloat16")) for c in ("gqa_rank_mod_deep", "gqa_ok_deep")})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", ["gqa_rank_mod", "gqa_rank_mod_deep"])
def test_a_wrong_kv_head_at_tp4_only_is_a_bug_there(runs, case):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["4"]
    assert s["degrees"]["2"]["class"] == "rounding" and leading_bug(s["degrees"]["2"]) is None, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["4"])
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "attn", "sharding-bug"), lead
    assert lead["bound_ratio"] > (1e4 if case == "gqa_rank_mod" else 10), lead
    assert "BUG (a wrong result, not rounding) at TP=4 forward: attn" in stdout, stdout


def test_the_twin_is_rounding_at_every_degree(runs):
    s, stdout, gate = runs["gqa_ok_deep"]
    assert s["class"] == "rounding" and gate == 1, s["degrees"]
    for tp in ("2", "4"):
        assert not s["degrees"][tp].get("findings"), (tp, s["degrees"][tp].get("findings"))
    assert "BUG" not in stdout
