"""A hand-written row-parallel layer whose rank partials cancel (tests/models/planted/cancel_handwritten.py):
the user's own F.linear on its slice of K and its own all-reduce, no plan. In bf16 each rank's partial,
30x the output, is rounded before the all-reduce. diff/rank_partials gave its floor only to a plan's
RowwiseParallel Linear: on 170f498 this correct layer read `sharding-bug` (`forward: block.down`, 2.8x
beyond rounding, gate 4). Its weight, recorded cut on its input dim (the ranks' shards), now gives it
the same floor (diff/generic_bound._partials); a bias every rank adds beside it (`block.proj`) is
still the BUG. The backward mirror (cancel_col): a hand-written column-parallel layer whose rows cancel
makes each rank's share of the input grad 30x the sum, rounded before the all-reduce - on 170f498
`backward: embed (grad_out 0)` read `sharding-bug`, 2.3x; its consumers' weights cut on their output
dim now give the grad the same floor (rank_partials.dgrad_partials); a second block whose input grad's
all-reduce is forgotten (cancel_col_bug) is still the BUG."""
import pytest

from conftest import compare_planted


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {c: ("cancel_handwritten", c, ("--tp", "1,2", "--dtype", "bfloat16"))
             for c in ("cancel_hand_bias", "cancel_col", "cancel_col_bug")}
    # hash-first capture: the values come from the second pass's region, which must hold the consumers'
    # weights and output grads the floor is formed from
    cases.update({f"{c}-hash": ("cancel_handwritten", c, ("--tp", "1,2", "--dtype", "bfloat16", "--capture", "hash"))
                  for c in ("cancel_col", "cancel_col_bug")})
    return compare_planted(tmp_path_factory, cases)


def test_a_correct_handwritten_row_parallel_layer_is_rounding_and_a_bias_beside_it_the_bug(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["cancel_hand_bias"]
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert (fd["module"], fd["cause"]) == ("block.down", "row-parallel-reduction"), fd
    lead = leading_bug(d)
    assert lead is not None and (lead["module"], lead["cause"]) == ("block.proj", "sharding-bug"), lead
    causes = {f["key"]: f["cause"] for f in d["findings"] if "key" in f}
    assert "s0/forward/block.down/out#0/0" not in causes, causes
    assert gate == 4, stdout


@pytest.mark.parametrize("case", ["cancel_col", "cancel_col-hash"])
def test_a_correct_handwritten_column_parallel_input_grad_with_cancelling_partials_is_rounding(runs, case):
    """cancel_col-hash (reviewer hreview13): on c8df0f6 `--capture hash` read `sharding-bug`, 2.3x, gate 4 -
    its second pass recorded `block` (the grad's sole consumer) but not `block.up`, whose weight and output
    grad the floor needs (runner/drill.py now records every consumer)."""
    s, stdout, gate = runs[case]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d.get("findings"), d.get("findings")
    fd = d["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/backward/embed/grad_out#0/0", "column-parallel-dgrad"), fd
    assert "BUG" not in stdout and gate == 1, stdout


@pytest.mark.parametrize("case", ["cancel_col_bug", "cancel_col_bug-hash"])
def test_a_forgotten_input_grad_all_reduce_after_it_is_still_the_bug(runs, case):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    # block's input grad: each rank's share, which adds up to the reference within bf16's rounding -
    # read as an unreduced partial grad and left uncompared, as it is in float32; then the first record
    # it makes wrong, block.up's weight grad (reviewer hreview13: diff/partials.partial_sum in bf16)
    assert lead is not None and lead["key"] in ("s0/backward/block/grad_out#0/0",
                                                "s0/backward/block.up/param_grad#0/weight"), lead
    assert lead["cause"] in ("sharding-bug", "rank-inconsistent-replica"), lead
    assert gate == 4, stdout
