"""A vocabulary padded and masked to -inf in the model's own logits (tests/models/masked_vocab_llama.py:
100 real ids, 128 columns, the padding's logits -inf, a vocab-parallel head), compared as a user runs it.

Main at 4ff4ada read the correct model as NON-FINITE (the loss phase's logits held -inf) and gave the
logprobs and the loss a NaN bound (-inf - -inf in logprob_bound), under which `diff > bound` is False:
a cross-entropy log(TP) off read within it. A column -inf at one side only made the bound infinite
(and its check's ratio inf / inf = NaN, within). Under --capture hash the logits' -inf counted as
NaN/Inf as well, and a capture's loss (judged to first order from the model's outputs) went unjudged
on the -inf: its log(TP)-off loss read rounding only (tests/user_masked_capture.py). Now a column -inf at both sides is an exact 0 in
either softmax and adds no rounding; a row with a column -inf at one side only is no rounding at all.
"""
import json
import math

import pytest
import torch

from conftest import run_cli

MODEL = "py:tests/models/masked_vocab_llama.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, more in (("masked_ok", ()), ("masked_loss_mean", ()), ("masked_mask_local", ()),
                       ("masked_ok_hash", ("--capture", "hash"))):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", MODEL + case.removesuffix("_hash"), "--tp", "1,2", "--no-baseline",
                    "--no-confirm", *more, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        rows = {r.split(",")[2]: dict(zip(HEAD, r.split(","))) for r in (d / "diff.csv").read_text().splitlines()[1:]}
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, rows,
                     run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


HEAD = ("degree,idx,key,step,phase,module,kind,call,name,cls,style,layout,dtype,shape,bitwise,rank_consistent,"
        "max_abs,max_rel,max_ulp,mismatch_fraction,bound,beyond_bound").split(",")
LP, LOSS = "s0/loss/model/logprobs#0/logprobs", "s0/loss/model/loss#0/loss"


def test_masked_vocabulary_reads_rounding(runs):
    s, stdout, rows, gate = runs["masked_ok"]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("findings") and gate == 0, (s["class"], e.get("findings"), stdout[-1500:])
    for k in (LP, LOSS):
        # a real number, the rounding of this loss: not NaN (which no difference is beyond), not inf
        b = float(rows[k]["bound"] or "nan")
        assert 0 < b < 1e-3 and rows[k]["beyond_bound"] == "False", rows[k]
        assert 0 < float(rows[k]["max_abs"]) <= b, rows[k]


def test_masked_vocabulary_reads_rounding_under_hash_capture(runs):
    # the hashed logits' statistics count NaN and Inf together: their -inf is a mask there too
    s, stdout, rows, gate = runs["masked_ok_hash"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings") and gate == 0, (s["class"], stdout[-1500:])


def test_loss_log_tp_off_is_a_bug(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, rows, gate = runs["masked_loss_mean"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, (s["class"], stdout[-1500:])
    assert (lead["phase"], lead["kind"], lead["cause"]) == ("loss", "loss", "sharding-bug"), lead
    assert lead["bound_ratio"] > 1e3 and gate == 4, (lead, gate)
    assert abs(float(rows[LOSS]["max_abs"]) - math.log(2)) < 1e-5, rows[LOSS]


def test_column_masked_at_one_side_never_passes(runs):
    s, stdout, rows, gate = runs["masked_mask_local"]
    assert s["class"] == "bug" and gate == 4, (s["class"], gate, stdout[-1500:])
    # TP=2 masks 28 real ids that TP=1 keeps: the logprobs and the loss read beyond any rounding
    for k in (LP, LOSS):
        assert rows[k]["beyond_bound"] == "True", rows[k]


def test_logprob_bound_of_masked_columns():
    from tpdiag.diff.bounds import check, logprob_bound

    g = torch.Generator().manual_seed(0)
    z1 = torch.randn(3, 12, generator=g)
    z1[:, 9:] = float("-inf")  # three masked columns in every row
    zn = z1.clone()
    zn[:, :9] += 1e-6 * torch.randn(3, 9, generator=g)
    lp1, lpn = z1.log_softmax(-1)[:, 0], zn.log_softmax(-1)[:, 0]
    b = logprob_bound(z1, zn, lp1, lpn)
    # the masked columns add nothing: the bound is that of the nine real columns, the same width's gamma
    pad = torch.full((3, 3), -30.0)
    ref = logprob_bound(torch.cat([z1[:, :9], pad], -1), torch.cat([zn[:, :9], pad], -1), lp1, lpn)
    assert torch.isfinite(b).all() and torch.allclose(b, ref, rtol=1e-12, atol=0), (b, ref)
    assert not check(lp1, lpn, b).beyond
    # column 3 masked at one side only, a finite logprob that moved: no rounding explains the row
    zo = zn.clone()
    zo[1, 3] = float("-inf")
    lpo = zo.log_softmax(-1)[:, 0]
    bo = logprob_bound(z1, zo, lp1, lpo)
    assert bo[1] == 0 and torch.equal(bo[[0, 2]], b[[0, 2]]), bo
    assert check(lp1, lpo, bo).beyond
    # a NaN logit at both sides is no mask; a NaN bound is never within (a NaN logprob either)
    zq = z1.clone()
    zq[2, 0] = float("nan")
    assert logprob_bound(zq, zq.clone(), lp1, lpn)[2] == 0
    assert check(lp1, lpn, torch.full((3,), float("nan"))).beyond
    # a logprob -inf at both sides (a label on a masked column) is no difference, the loss is judged
    lm = torch.tensor([float("-inf"), -1.0, -2.0])
    assert not check(lm, lm.clone(), logprob_bound(z1, z1.clone(), lm, lm.clone())).beyond


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    from user_worlds import capture_worlds

    return capture_worlds(tmp_path_factory.mktemp("masked"), "user_masked_capture", "step",
                          ((1, "ok"), (2, "ok"), (2, "loss_mean")))


@pytest.mark.parametrize("other,bug", [("2-ok", False), ("2-loss_mean", True)])
def test_captured_loss_of_a_masked_vocabulary(captures, tmp_path, other, bug):
    """A capture has no logits records: its loss is judged to first order from the model's outputs
    (-inf at both sides: moved by nothing) times their grads. Main skipped the judgement on the -inf,
    and the log(TP)-off loss read rounding only."""
    from tpdiag.diff.classes import leading_bug

    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-ok"), str(captures / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    s, gate = json.loads((out / "summary.json").read_text()), run_cli("gate", str(out), "--allow", "rounding").returncode
    lead = leading_bug(s["degrees"]["2"])
    if not bug:
        assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings") and gate == 0, (s["class"], p.stdout)
        return
    assert s["class"] == "bug" and lead is not None, (s["class"], p.stdout)
    assert (lead["phase"], lead["kind"], lead["cause"]) == ("loss", "loss", "sharding-bug"), lead
    assert lead["bound_ratio"] > 100 and gate == 4, (lead, gate)  # ~490x
