"""RL loss terms on the vocab shard (tests/models/planted/rl_shard_loss.py), run as a user runs them:
`tpdiag compare py:... --tp 1,2 --no-baseline --no-confirm`, then `tpdiag gate`.

entropy_id_bwd: an entropy bonus whose normaliser (the exp-sum) is all-reduced with Megatron's
identity backward while each rank's entropy terms differ - each rank's grad of the normaliser is its
own shard's share. The loss is exact; every row of the logits' grad is off by 1e-3 of itself (204671
ULP). Main at 0428e29 read it `vocab-parallel-softmax`, rounding only, gate 1: the grad of an output
no module consumed is judged by a cross-entropy's form (diff/loss_grad.py), which an entropy term
is not. It is judged row by row against how far the logits moved now
(diff/loss_first_order.grad_bound). Its twin sums the ranks' grads of the normaliser
(torch.distributed.nn.functional.all_reduce)."""
import json

import pytest

from conftest import run_cli

CASES = ("entropy_id_bwd", "entropy_ok")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/rl_shard_loss.py:{case}", "--tp", "1,2",
                    "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        g = run_cli("gate", str(d))
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, g.returncode)
    return out


def test_the_entropy_with_its_normalisers_grad_summed_is_rounding_only(runs):
    s, stdout, gate = runs["entropy_ok"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1, stdout


def test_an_identity_backward_normaliser_is_a_bug_in_the_logits_grad(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["entropy_id_bwd"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == \
        ("backward", "head", "grad_out", "sharding-bug"), lead
    assert lead["bound_ratio"] > 8, lead
    assert "BUG (a wrong result, not rounding) at TP=2 backward: head (grad_out 0)" in stdout, stdout
    assert gate == 4
