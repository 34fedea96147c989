"""A user's own vocab-parallel cross-entropy (an autograd Function over a hand-written column-parallel
head; tests/models/planted/vocab_loss.py) whose backward is wrong on ONE rank only - the one-hot not
subtracted, the shard scaled by TP, a softmax over the rank's local exp sum - run as a user runs it:
`tpdiag compare py:... --tp 1,2`, then `tpdiag gate`.

Main at c2294f0 read every one of them `vocab-parallel-softmax`, rounding only, gate 1: the loss and
the logprobs are exact, and the logits' grad (the grad of an output no module consumed) had no bound
and nothing re-executed it. It is now judged against a cross-entropy's grad computed in float64
from the logits (diff/loss_grad.py): BUG at backward: head (grad_out 0), gate 4; the twin rounding.
"""
import json

import pytest
import torch

from conftest import run_cli

CASES = {c: (c, "float32") for c in ("vce_ok", "vce_onehot", "vce_scale", "vce_stale")}
CASES.update({f"{c}_bf16": (c, "bfloat16") for c in ("vce_ok", "vce_onehot")})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, (func, dtype) in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/vocab_loss.py:{func}", "--tp", "1,2",
                    "--dtype", dtype, "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


@pytest.mark.parametrize("case", ["vce_ok", "vce_ok_bf16"])
def test_the_correct_loss_is_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])


@pytest.mark.parametrize("case,ratio", [("vce_onehot", 1e5), ("vce_scale", 1e5), ("vce_stale", 1e4),
                                        ("vce_onehot_bf16", 5)])
def test_one_ranks_wrong_logits_grad_is_a_bug(runs, case, ratio):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "backward", "head", "grad_out", "sharding-bug"), lead
    assert lead["bound_ratio"] > ratio, lead
    assert "BUG (a wrong result, not rounding) at TP=2 backward: head (grad_out 0)" in stdout and gate == 4
    # the bug's float64 verdict says where its error sits, whether it is the first divergence (float32
    # on the host) or a finding behind the logprobs' rounding (bfloat16; float32 on a GPU, whose
    # vocab-parallel softmax rounds: the line was missing there, seen on 2x H200)
    assert "100% of this side's error in rank 1's vocab shard" in stdout, stdout


def _ce_grad(z, y):
    g = torch.softmax(z.double(), -1)
    g[torch.arange(len(y)), y] -= 1
    return (g / len(y)).float()


def test_the_closed_form_judges_each_side_on_its_own_logits():
    from tpdiag.diff.loss_grad import _verdict

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(24, 64, generator=gen) * 3
    y = torch.randint(0, 64, (24,), generator=gen)
    ref = torch.nn.functional.cross_entropy(z.requires_grad_(), y)
    g1 = torch.autograd.grad(ref, z)[0]
    z = z.detach()
    # a reordered exp sum: the log-softmax over two shards' sums
    zs = z - z.amax(-1, keepdim=True)
    s2 = zs[:, :32].exp().sum(-1) + zs[:, 32:].exp().sum(-1)
    gn = (zs.exp() / s2.unsqueeze(-1) - torch.nn.functional.one_hot(y, 64)) / 24
    u = 2.0 ** -24
    near = _verdict(z, z, y, g1, gn, u, 2)
    assert near is not None and not near["far"], near
    bad = gn.clone()
    bad[:, 32:] *= 1.01  # one shard 1% off
    far = _verdict(z, z, y, g1, bad, u, 2)
    assert far["far"] and far["block_share"][1] > 0.99, far
    # this side's logits moved (upstream rounding): judged against ITS logits' grad, near
    z2 = z + 1e-3 * torch.randn(z.shape, generator=gen)
    assert not _verdict(z, z2, y, g1, _ce_grad(z2, y), u, 2)["far"]
    # a loss of another form at the reference (a z-loss of weight 1e-2): not judged
    zl = z.clone().requires_grad_()
    lse = torch.logsumexp(zl, -1)
    other = torch.nn.functional.cross_entropy(zl, y) + 1e-2 * (lse ** 2).mean()
    assert _verdict(z, z, y, torch.autograd.grad(other, zl)[0], gn, u, 2) is None


def test_a_token_weight_that_is_a_function_of_the_logits_is_no_bug():
    """PPO's clipped ratio exp(logp - logp_old) times the advantage: each row is a cross-entropy
    form with a weight that moves with logp. The reference's fitted weights read this correct loss
    far (on 626f7d4) both where this side's logits are a few roundings apart (ratio ~4 in float32)
    and where they are bitwise equal but logp comes from a vocab-parallel log-softmax (two shards'
    exp sums: ratio ~3 at logits of scale 10). Each side's own fit judges the form within the rows:
    near, and a one-shard mistake is still far and named by its shard."""
    from tpdiag.diff.loss_grad import _verdict

    gen = torch.Generator().manual_seed(0)
    T, V = 64, 1024
    u = 2.0 ** -24
    z1 = torch.randn(T, V, generator=gen) * 10
    zn = z1 * (1 + 4 * u * torch.randn(T, V, generator=gen))
    y = torch.randint(0, V, (T,), generator=gen)
    old = torch.log_softmax(z1, -1).gather(1, y[:, None]).squeeze(1) + 0.1 * torch.randn(T, generator=gen)
    adv = torch.randn(T, generator=gen)

    def grad(z, sharded=False):
        z = z.clone().requires_grad_()
        zs = z - z.amax(-1, keepdim=True).detach()
        lse = (zs[:, :V // 2].exp().sum(-1) + zs[:, V // 2:].exp().sum(-1)).log() if sharded else \
            torch.logsumexp(zs, -1)
        r = (zs.gather(1, y[:, None]).squeeze(1) - lse - old).exp()
        return torch.autograd.grad(-torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).mean(), z)[0]

    g1 = grad(z1)
    assert not torch.equal(z1, zn)
    for z, gn in ((zn, grad(zn)), (z1, grad(z1, sharded=True))):
        near = _verdict(z1, z, y, g1, gn, u, 2)
        assert near is not None and not near["far"], near
        bad = gn.clone()
        bad[:, V // 2:] *= 1.01  # one shard 1% off
        far = _verdict(z1, z, y, g1, bad, u, 2)
        assert far["far"] and far["ratio"] > 100 and far["block_share"][1] > 0.9, far
