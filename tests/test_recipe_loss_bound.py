"""The loss's rounding bound under a trainer's recipe (`--logprob/--trainer-temperature`, helper
hhook16). The loss is the cross-entropy of the logits at temperature 1 whatever the recipe, but its
bound took the recipe's logprobs for its 4u(1 + |a| + |b|) and u_out(|a| + |b|) terms: z_y/T - lse(z/T)
grows as 1/T, so the bound was looser at T < 1 and TIGHTER than the loss's own rounding at T > 1
(diff/loss_bounds._loss_logprobs). Now it is the loss's own: the same bound at every temperature
(on the old code it moved with T), a correct loss within it, a real loss bug beyond it."""
import pytest
import torch
import torch.nn.functional as F

V, N = 256, 64


def _run(T, bug=False, labels=True):
    from tpdiag.diff.bounds import logprob_bound
    from tpdiag.diff.engine import DegreeDiff
    from tpdiag.diff.loss_bounds import loss_bounds
    from tpdiag.records.keys import record_key
    from tpdiag.runner.recipe import logprobs, parse

    g = torch.Generator().manual_seed(0)
    z1 = torch.randn(N, V, generator=g) * 3
    zn = z1.clone()  # TP=2's logits: 1 ULP off at 8 ids a row (a reordered sum's rounding)
    idx = torch.randint(0, V, (N, 8), generator=g)
    zn.scatter_(1, idx, torch.nextafter(zn.gather(1, idx), torch.full((N, 8), 1e9)))
    lab = torch.randint(0, V, (N,), generator=g)
    lab[-1] = -100  # the last position has no next token
    rec = parse("log-softmax", T, "float32")
    p1, pn = logprobs(z1, lab, rec), logprobs(zn, lab, rec)
    a = F.cross_entropy(z1, lab, ignore_index=-100)
    # the bug: a mean over every position, the ignored one counted (each rank's own count, say)
    b = F.cross_entropy(zn, lab, ignore_index=-100, reduction="sum") / N if bug else F.cross_entropy(zn, lab, ignore_index=-100)
    keys = {k: record_key(0, "loss", "model", k, 0, k) for k in ("logits", "logprobs", "loss")}
    rows = [{"step": 0, "phase": "loss", "kind": k, "key": keys[k]} for k in ("logprobs", "loss")]
    t = {keys["logits"]: (z1, zn), keys["logprobs"]: (p1, pn), keys["loss"]: (a.reshape(1), b.reshape(1))}
    if labels:
        t[record_key(0, "init", "model", "batch", 0, "labels")] = (lab, lab)
    dd = DegreeDiff("2", rows, [], [], tensors=t,
                    recipe={"logprob": "log-softmax", "trainer_temperature": T, "temperature_in": "float32"})
    loss_bounds(dd)
    assert rows[0]["bound"] > 0 and not rows[0]["beyond_bound"]  # the recipe's own logprobs: within theirs
    return rows[1], logprob_bound


@pytest.mark.parametrize("T", [0.5, 2.0])
def test_the_loss_bound_is_the_losss_own_at_any_temperature(T):
    row, _ = _run(T)
    same, _ = _run(1.0)
    assert not row["beyond_bound"], row  # the correct loss passes
    assert row["bound"] == same["bound"], (row["bound"], same["bound"])  # the loss does not depend on T


def test_a_real_loss_bug_at_half_temperature_still_fails():
    row, _ = _run(0.5, bug=True)
    assert row["beyond_bound"] and row["bound_ratio"] > 10, row


def test_without_labels_a_bound_no_tighter():
    row, _ = _run(0.5, labels=False)
    withl, _ = _run(0.5)
    assert row["bound"] >= withl["bound"] and not row["beyond_bound"], (row["bound"], withl["bound"])


def test_ignored_positions_do_not_tighten_the_loss_bound():
    """A cross-entropy over 16 counted tokens of 64 (the rest ignored: padding, prompts) is their
    mean: its bound is their bounds' mean. Here TP=2's logits differ from TP=1's by d on the counted
    rows only - the target logit up, the others down, which moves each counted log-prob by ~2d,
    inside its own bound 2d + ... - and agree on the ignored rows. The mean over all 64 positions
    took the ignored rows' near-zero bounds in: the correct loss read ~3x beyond it."""
    from tpdiag.diff.engine import DegreeDiff
    from tpdiag.diff.loss_bounds import loss_bounds
    from tpdiag.records.keys import record_key

    g = torch.Generator().manual_seed(0)
    z1 = torch.randn(N, V, generator=g) * 3
    lab = torch.full((N,), -100)
    counted = torch.arange(0, N, 4)
    lab[counted] = torch.randint(0, V, (len(counted),), generator=g)
    d = 1e-3
    zn = z1.clone()
    zn[counted] -= d
    zn[counted, lab[counted]] += 2 * d
    p1 = torch.where(lab >= 0, F.log_softmax(z1, -1).gather(-1, lab.clamp_min(0)[:, None])[:, 0], 0.0)
    pn = torch.where(lab >= 0, F.log_softmax(zn, -1).gather(-1, lab.clamp_min(0)[:, None])[:, 0], 0.0)
    a, b = F.cross_entropy(z1, lab, ignore_index=-100), F.cross_entropy(zn, lab, ignore_index=-100)
    keys = {k: record_key(0, "loss", "model", k, 0, k) for k in ("logits", "logprobs", "loss")}
    rows = [{"step": 0, "phase": "loss", "kind": k, "key": keys[k]} for k in ("logprobs", "loss")]
    t = {keys["logits"]: (z1, zn), keys["logprobs"]: (p1, pn), keys["loss"]: (a.reshape(1), b.reshape(1)),
         record_key(0, "init", "model", "batch", 0, "labels"): (lab, lab)}
    loss_bounds(DegreeDiff("2", rows, [], [], tensors=t))
    assert not rows[0]["beyond_bound"], rows[0]  # each log-prob within its own bound
    assert abs(float(b - a)) > 1.5 * d and not rows[1]["beyond_bound"], rows[1]


def _bf16_loss_bound(T):
    """The loss row's bound for bfloat16 logits and a bfloat16 loss (stock cross_entropy on them)
    under a float32 recipe at temperature T."""
    from tpdiag.diff.engine import DegreeDiff
    from tpdiag.diff.loss_bounds import loss_bounds
    from tpdiag.records.keys import record_key
    from tpdiag.runner.recipe import logprobs, parse

    g = torch.Generator().manual_seed(1)
    z1 = (torch.randn(N, V, generator=g) * 3).bfloat16()
    zn = z1.clone()
    idx = torch.randint(0, V, (N, 8), generator=g)
    zn.scatter_(1, idx, torch.nextafter(zn.gather(1, idx), torch.full((N, 8), 1e9, dtype=torch.bfloat16)))
    lab = torch.randint(0, V, (N,), generator=g)
    rec = parse("log-softmax", T, "float32")
    p1, pn = logprobs(z1, lab, rec), logprobs(zn, lab, rec)
    a, b = F.cross_entropy(z1, lab), F.cross_entropy(zn, lab)
    assert a.dtype == torch.bfloat16 and p1.dtype == torch.float32
    keys = {k: record_key(0, "loss", "model", k, 0, k) for k in ("logits", "logprobs", "loss")}
    rows = [{"step": 0, "phase": "loss", "kind": k, "key": keys[k]} for k in ("logprobs", "loss")]
    t = {keys["logits"]: (z1, zn), keys["logprobs"]: (p1, pn), keys["loss"]: (a.reshape(1), b.reshape(1)),
         record_key(0, "init", "model", "batch", 0, "labels"): (lab, lab)}
    loss_bounds(DegreeDiff("2", rows, [], [], tensors=t,
                           recipe={"logprob": "log-softmax", "trainer_temperature": T, "temperature_in": "float32"}))
    return rows[1]["bound"]


def test_a_16_bit_losss_own_rounding_term_is_of_its_own_logprobs():
    """A bf16 loss rounds each token's log-softmax at temperature 1 to bf16 before the mean: that
    term is u_bf16 (|l_1| + |l_N|) of the LOSS's log-probs. It took the recipe's (z_y/T - lse(z/T)),
    ~1/T of them: at T = 2 the bound was tighter than the loss's own rounding (hreview16); now the
    same bound at every temperature, as the float32 terms already were."""
    assert _bf16_loss_bound(2.0) == _bf16_loss_bound(1.0)
