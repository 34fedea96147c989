"""A user's own loss in a captured TP loop (tests/user_loss_shard.py: loss_parallel's cross-entropy
plus an entropy bonus written by hand on the vocab shard, gloo worlds), then `tpdiag diff` and
`tpdiag gate` as a user runs them.

Main at 0428e29 read both mistakes `rounding only` (gate 1): nothing re-executes a capture's loss
and the built-in loss bound needs logprobs records a capture does not write.
- entropy_local (the shard's own softmax): the loss 0.6% off. Judged now to first order from its
  inputs (diff/loss_first_order.first_order_bound): the model's outputs moved by 1e-7, times their
  recorded grads, plus the loss's own roundings - 18x beyond.
- entropy_grad (the normaliser all-reduced with an identity backward while each rank's terms
  differ): the loss bitwise, every row of the logits' grad 2e-3 of itself off while the logits
  moved by 2.4e-7. Judged now row by row against how far the output moved (grad_bound)."""
import json

import pytest

from conftest import run_cli
from user_worlds import capture_worlds


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("loss"), "user_loss_shard", "step",
                          ((1, "entropy_ok"), (2, "entropy_ok"), (2, "entropy_local"), (2, "entropy_grad")))


def _diff(captures, tmp_path, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-entropy_ok"), str(captures / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text()), p.stdout, run_cli("gate", str(out)).returncode


def test_the_correct_entropy_bonus_is_rounding_only(captures, tmp_path):
    s, stdout, gate = _diff(captures, tmp_path, "2-entropy_ok")
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d["findings"], d["findings"]
    assert "BUG" not in stdout and gate == 1, stdout


@pytest.mark.parametrize("bug,where", [
    ("entropy_local", ("loss", "model", "loss")),
    ("entropy_grad", ("backward", "head", "grad_out")),
])
def test_a_wrong_loss_or_loss_grad_is_a_bug(captures, tmp_path, bug, where):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = _diff(captures, tmp_path, f"2-{bug}")
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (*where, "sharding-bug"), lead
    assert lead["bound_ratio"] > 4, lead
    assert "BUG (a wrong result, not rounding) at TP=2" in stdout and gate == 4, stdout
