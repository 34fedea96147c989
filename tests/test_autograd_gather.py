"""A column-parallel gather_output through torch.distributed.nn.functional.all_gather, feeding
replicated layers (tests/models/planted/autograd_gather.py, helper hred14): its backward sums the
ranks' (already whole) grads - `up`'s weight grad 2x at TP=2, the forward exact: BUG at
`backward: up (param_grad weight)`. The twin (Megatron's gather: backward keeps the rank's columns)
reads rounding."""
import pytest

from conftest import compare_planted

CASES = {c: ("autograd_gather", c, ("--tp", "1,2")) for c in ("gather_autograd", "gather_slice")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_an_autograd_all_gather_before_replicated_layers_doubles_the_grads(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["gather_autograd"]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["2"])
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == \
        ("backward", "up", "param_grad", "sharding-bug"), lead
    assert s["degrees"]["2"]["logprobs"]["bitwise"], s["degrees"]["2"]["logprobs"]


def test_megatrons_gather_is_rounding(runs):
    s, stdout, gate = runs["gather_slice"]
    assert s["class"] == "rounding" and gate == 1, s["degrees"]["2"]
    assert not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert "BUG" not in stdout
