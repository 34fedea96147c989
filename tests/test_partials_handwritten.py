"""A hand-written row-parallel layer whose rank partials cancel (tests/models/planted/cancel_handwritten.py):
the user's own F.linear on its slice of K and its own all-reduce, no plan. In bf16 each rank's partial,
30x the output, is rounded before the all-reduce. diff/rank_partials gave its floor only to a plan's
RowwiseParallel Linear: on 170f498 this correct layer read `sharding-bug` (`forward: block.down`, 2.8x
beyond rounding, gate 4). Its weight, recorded cut on its input dim (the ranks' shards), now gives it
the same floor (diff/generic_bound._partials); a bias every rank adds beside it (`block.proj`) is
still the BUG."""
import pytest

from conftest import compare_planted


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, {c: ("cancel_handwritten", c, ("--tp", "1,2", "--dtype", "bfloat16"))
                                              for c in ("cancel_hand", "cancel_hand_bias")})


def test_a_correct_handwritten_row_parallel_layer_with_cancelling_partials_is_rounding(runs):
    s, stdout, gate = runs["cancel_hand"]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d.get("findings"), d.get("findings")
    fd = d["first_divergence"]
    assert (fd["module"], fd["cause"]) == ("block.down", "row-parallel-reduction"), fd
    assert "BUG" not in stdout and gate == 1, stdout


def test_a_bias_added_on_every_rank_beside_it_is_still_the_bug(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["cancel_hand_bias"]
    d = s["degrees"]["2"]
    lead = leading_bug(d)
    assert lead is not None and (lead["module"], lead["cause"]) == ("block.proj", "sharding-bug"), lead
    causes = {f["key"]: f["cause"] for f in d["findings"] if "key" in f}
    assert "s0/forward/block.down/out#0/0" not in causes, causes
    assert gate == 4, stdout
