"""HF-style GQA split by a plan with the KV projections left whole on every rank
(tests/models/planted/gqa_nrep.py, helper hred14): `repeat_kv`'s group from the local shapes is a
BUG at the attention op at TP=2; the forward fixed but the whole k/v projections' grads never summed
over the ranks is a BUG where their replicas part (rank-inconsistent-replica); the twin (their grads
all-reduced) is rounding."""
import pytest

from conftest import compare_planted

CASES = {c: ("gqa_nrep", c, ("--tp", "1,2")) for c in ("gqa_nrep_local", "gqa_nrep_nosync", "gqa_nrep_ok")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_group_size_from_the_local_shapes_is_a_bug_at_the_attention(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["gqa_nrep_local"]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["2"])
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "self_attn", "sharding-bug"), lead
    assert "scaled_dot_product" in (lead["op"] or ""), lead


def test_whole_kv_projections_whose_grads_are_not_summed_part_their_replicas(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["gqa_nrep_nosync"]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["2"])
    assert (lead["phase"], lead["kind"], lead["cause"]) == ("backward", "param_grad", "rank-inconsistent-replica"), lead
    assert lead["module"] in ("self_attn.k_proj", "self_attn.v_proj"), lead
    assert s["degrees"]["2"]["logprobs"]["max_abs"] < 1e-5  # the forward is right


def test_the_twin_is_rounding(runs):
    s, stdout, gate = runs["gqa_nrep_ok"]
    assert s["class"] == "rounding" and gate == 1, s["degrees"]["2"]
    assert not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert "BUG" not in stdout
