"""A user's own term in a grad hook, computed another number of times at TP > 1
(tests/models/planted/shard_stats.py, helper hbug13b), run as a user runs it: `tpdiag compare
py:... --tp 1,2`, then `tpdiag gate`.

- wd_twice: L2 weight decay (g + wd * p) added in each whole-weight parameter's grad hook BEFORE
  the ranks' grads are summed: at TP=2 the sum holds it twice. Main at 80a2189 read it `rounding
  only`, gate 1: the module's float64 backward does not compute the hook's term, so the reference
  is itself 6-39% from it and "near" was measured against that level (err 2x ref_err, within 8x).
  The two sides' residuals from their own re-executions are now compared: parallel, one factor
  apart (2x), not one offset -> sharding-bug at `backward: ffn (param_grad up)`, gate 4.
- wd_ok: the decay added after the sum (once at every degree): rounding only, gate 1.
- rms_local: an RMSNorm over the column-parallel hidden width from the rank's own columns, before
  the row-parallel all-reduce written as a module of its own (ffn.sum_ranks). Main at 80a2189 named
  that module's input `rank-inconsistent-replica`: its copies are the ranks' shares of the sum the
  module reduces (its output one value on every rank), not replicas; shares that do not add up are
  a `sharding-bug` (diff/partials.reduced), found down to the norm's op `ffn :: aten::mul`.
"""
import json

import pytest
import torch

from conftest import run_cli

SPEC = "py:tests/models/planted/shard_stats.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("wd_twice", "wd_ok", "rms_local", "wd_ok-bf16", "rms_local-bf16"):
        d = tmp_path_factory.mktemp(case) / "r"
        more = ("--dtype", "bfloat16") if case.endswith("-bf16") else ()
        p = run_cli("compare", "--model", SPEC + case.removesuffix("-bf16"), "--tp", "1,2", "--no-baseline",
                    "--no-confirm", *more, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


def test_weight_decay_added_on_every_rank_before_the_sum_is_a_bug(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["wd_twice"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"].get("findings")
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == ("backward", "ffn", "param_grad",
                                                                            "sharding-bug"), lead
    assert "does not compute" in stdout and "is 2x the reference's" in stdout, stdout[-2000:]
    assert gate == 4


@pytest.mark.parametrize("case", ["wd_ok", "wd_ok-bf16"])
def test_weight_decay_added_once_is_rounding_only(runs, case):
    """wd_ok-bf16 (reviewer hreview13): on c8df0f6 (and 170f498) `ffn.sum_ranks`' input - each rank's
    bf16 share of the sum of squares its module all-reduces - read `sharding-bug` ("shares that do not
    add up"): the shares add up to the reference within bf16's own rounding, not within 1/1000 of a
    copy's distance (diff/partials.partial_sum)."""
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])


def test_a_norm_over_the_ranks_own_columns_is_a_sharding_bug_at_its_op(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["rms_local"]
    d = s["degrees"]["2"]
    lead = leading_bug(d)
    assert s["class"] == "bug" and gate == 4
    # in bf16 too: its shares are wrong by far more than bf16's rounding
    sb = runs["rms_local-bf16"][0]
    assert sb["class"] == "bug" and runs["rms_local-bf16"][2] == 4, sb["degrees"]["2"].get("first_divergence")
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "ffn", "sharding-bug"), lead
    assert lead.get("op") == "aten::mul", lead
    assert "rank-inconsistent-replica" not in stdout, stdout[-2000:]
    assert all(f["cause"] == "sharding-bug" for f in d["findings"] if f["module"] == "ffn.sum_ranks"), d["findings"]


def test_the_residual_rule_leaves_one_offset_to_rounding():
    """Catastrophic cancellation (test_tp_misc's example: each side's row mean rounded its own way,
    one offset per side) moves the residual by "one factor" as well, but the difference is one
    value repeated: no finding. The hook's term (proportional to the weights) is."""
    from tpdiag.diff.oracle_own import _residual_norms, _residual_scaled

    g = torch.Generator().manual_seed(0)
    f = 1e-7 * torch.randn(64, generator=g, dtype=torch.float64)
    y_ref, y_n = (f - 3e-5).float(), (f - 4.5e-5).float()
    row = {}
    assert not _residual_scaled(row, y_ref, y_n, *_residual_norms(y_ref, y_n, f, f, None, None)) and "scale" not in row
    p = torch.randn(64, generator=g, dtype=torch.float64)
    grad = torch.randn(64, generator=g, dtype=torch.float64)
    y_ref, y_n = (grad + 0.01 * p).float(), (grad + 0.02 * p).float()
    row = {}
    assert _residual_scaled(row, y_ref, y_n, *_residual_norms(y_ref, y_n, grad, grad, None, None))
    assert abs(row["scale"] - 2) < 1e-3 and row["scale_of"] == "residual"
    # the same term at both sides: no finding
    row = {}
    assert not _residual_scaled(row, y_ref, y_ref.clone(), *_residual_norms(y_ref, y_ref, grad, grad, None, None))
    # two unrelated residuals, one 20x the other (each side's own rounding): nearly parallel by
    # their lengths alone, so no factor is read from them
    r = 1e-3 * torch.randn(64, generator=g, dtype=torch.float64)
    y_ref, y_n = (grad + r).float(), (grad + 0.05 * torch.randn(64, generator=g, dtype=torch.float64) * 1e-3).float()
    row = {}
    assert not _residual_scaled(row, y_ref, y_n, *_residual_norms(y_ref, y_n, grad, grad, None, None))
