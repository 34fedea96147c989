"""An RL trainer's vocab-parallel chosen-token logprobs under a PPO loss
(tests/models/planted/rl_logprob.py), run as a user runs them: `tpdiag compare py:... --tp 1,2
--no-baseline --no-confirm`, then `tpdiag gate`.

The loss tempers the logits (T = 0.7), so the logits' grad is a cross-entropy's of z / T, not of z:
in bfloat16 the reference is 13 roundings from the plain closed form, within diff/loss_grad's
FORM_ROUNDINGS, and its distance (5%, times the margin 8) was taken for the loss's rounding. Main at
00909fb read the target logit's grad TP times (target_sum_bwd) and the temperature applied twice
(temp_twice) `rounding only` in bfloat16 (compare's verdict; the gate's evidence check, exit 2,
caught the record). The residual off the closed form is the same function at both sides: its change
is judged against the grad's roundings and how far the logits moved."""
import json

import pytest
import torch

from conftest import run_cli

CASES = {"offset_global": "float32", "target_sum_bwd_bf16": "bfloat16", "temp_twice_bf16": "bfloat16",
         "logprob_ok_bf16": "bfloat16"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, dtype in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/rl_logprob.py:{case.removesuffix('_bf16')}",
                    "--tp", "1,2", "--dtype", dtype, "--no-baseline", "--no-confirm", "--out", str(d),
                    env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


def test_the_correct_tempered_ppo_loss_is_rounding_only_in_bf16(runs):
    s, stdout, gate = runs["logprob_ok_bf16"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])


@pytest.mark.parametrize("case,ratio", [("offset_global", 1e3), ("target_sum_bwd_bf16", 1.5),
                                        ("temp_twice_bf16", 1.5)])
def test_a_wrong_logprob_is_a_bug_in_the_logits_grad(runs, case, ratio):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "backward", "head", "grad_out", "sharding-bug"), lead
    assert lead["bound_ratio"] > ratio, lead
    assert "BUG (a wrong result, not rounding) at TP=2 backward: head (grad_out 0)" in stdout and gate == 4


def _tempered_ppo_grad(z, y, adv, temp, target_times=1.0):
    """The logits' grad of -mean(A * exp(logp - logp.detach())) with logp = log_softmax(z / temp)[y];
    target_times: the target logit's grad that many times (an all-reduce whose backward sums)."""
    p = torch.softmax(z.double() / temp, -1)
    g = p.clone()
    g[torch.arange(len(y)), y] -= 1
    g[torch.arange(len(y)), y] -= (target_times - 1) * 1.0
    return (-adv[:, None] * -g / temp / len(y)).to(torch.bfloat16)


def test_a_form_the_closed_form_leaves_out_is_no_rounding_allowance():
    """A tempered cross-entropy's grad in bfloat16 passes the closed form's check at the reference (5%
    off it, under 64 roundings); the same side with the target logit's grad twice is 9% off it, under
    the reference's 5% times the margin. Its residual moved by that 2x: far."""
    from tpdiag.diff.loss_grad import _verdict

    gen = torch.Generator().manual_seed(0)
    T, V = 64, 32
    z = (torch.randn(T, V, generator=gen)).to(torch.bfloat16)
    y = torch.randint(0, V, (T,), generator=gen)
    adv = torch.linspace(-1, 1, T, dtype=torch.float64)
    u = 2.0 ** -8
    g1 = _tempered_ppo_grad(z, y, adv, 0.7)
    near = _verdict(z, z, y, g1, g1.clone(), u, 2)
    assert near is not None and not near["far"] and near["ref_err"] > 4 * u, near
    twice = _verdict(z, z, y, g1, _tempered_ppo_grad(z, y, adv, 0.7, target_times=2.0), u, 2)
    assert twice is not None and twice["far"] and twice["err"] < twice["threshold"], twice
