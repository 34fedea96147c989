"""tests/test_loss_capture.py's user loss on a model laid out as an HF CausalLM (tests/user_loss_hf.py:
the body as `model`, the head as `lm_head`), captured in gloo worlds, then `tpdiag diff` and `gate`.

Since RECORD_FORMAT 3 such a root records as "(root)" and its `model` child (the body, returning hidden
states) keeps "model". diff/loss_first_order still took "model" for the root: the loss's input it
judges the grad of was the body's hidden states, the logits' grad no longer counted as the loss's,
and entropy_grad (the normaliser's identity backward: every row of the logits' grad 2e-3 of itself
off, the loss bitwise) read `rounding only` (gate 2) where 85e6ea9 read BUG at lm_head (gate 4)."""
import json

import pytest

from conftest import run_cli
from user_worlds import capture_worlds


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("loss_hf"), "user_loss_hf", "step",
                          ((1, "entropy_ok"), (2, "entropy_ok"), (2, "entropy_grad")))


def _diff(captures, tmp_path, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-entropy_ok"), str(captures / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text()), p.stdout, run_cli("gate", str(out)).returncode


def test_the_correct_loss_on_an_hf_layout_is_rounding_only(captures, tmp_path):
    s, stdout, gate = _diff(captures, tmp_path, "2-entropy_ok")
    assert s["class"] == "rounding" and not s["degrees"]["2"]["findings"], s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1, stdout


def test_a_wrong_loss_grad_on_an_hf_layout_is_a_bug_at_the_head(captures, tmp_path):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = _diff(captures, tmp_path, "2-entropy_grad")
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == \
        ("backward", "lm_head", "grad_out", "sharding-bug"), lead
    assert lead["bound_ratio"] > 4, lead
    # the body's hidden states are lm_head's input, not the loss's: their grad is judged by lm_head
    assert not any(f["module"] == "model" and f["kind"] == "grad_out" and f.get("cause") == "sharding-bug"
                   and "loss's grad" in (f.get("bound_model") or "") for f in s["degrees"]["2"]["findings"])
    assert "BUG (a wrong result, not rounding) at TP=2" in stdout and gate == 4, stdout
