"""A hand-written vocab-parallel embedding whose shard is an `nn.Embedding` looked up with LOCAL ids
(tests/models/planted/embed_padidx.py, helper hred14). The shard's input and output differ across
the ranks by design - the module around it masks and all-reduces them into one value: the ranks'
own values, not replicas (diff/rank_local.py). On the old code both cases read
`rank-inconsistent-replica` at `embed.shard`'s input: the twin a false BUG, the bug (a global
padding_idx on every shard: one row's grad dropped) named at the wrong record."""
import pytest

from conftest import compare_planted

CASES = {c: ("embed_padidx", c, ("--tp", "1,2")) for c in ("pad_every_shard", "pad_owner_only")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_padding_index_on_every_shard_is_a_bug_at_the_shards_weight_grad(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["pad_every_shard"]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["2"])
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == \
        ("backward", "embed.shard", "param_grad", "sharding-bug"), lead
    assert not any(f["cause"] == "rank-inconsistent-replica" for f in s["degrees"]["2"].get("findings", [])), s
    assert s["degrees"]["2"]["logprobs"]["bitwise"], s["degrees"]["2"]["logprobs"]  # the forward is exact


def test_the_shards_local_ids_are_no_replica(runs):
    s, stdout, gate = runs["pad_owner_only"]
    assert s["class"] in ("rounding", "identical") and gate in (0, 1), s["degrees"]["2"]
    assert "BUG" not in stdout, stdout
    nc = s["degrees"]["2"]["not_compared"]
    assert nc["why"].get("the ranks' own values inside embed") == 2, nc
    assert {"s0/forward/embed.shard/in#0/0", "s0/forward/embed.shard/out#0/0"} <= set(nc["module_records"]), nc
