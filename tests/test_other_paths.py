"""An input grad that flows through a residual add outside any module as well as through its
module consumer (tests/models/planted/residual_grad.py: `h = h + mlp(h)` in the model's forward).
The embedding's grad is the sum of the MLP's input grad and the grad through the add; it was
judged against the MLP's float64 input grad alone, a value the reference itself was 153% from,
so the threshold (8 x the reference's distance) judged nothing: a doubled input grad read
"rounding only", exit 1 (on 2205273, residual_doubled and gathered_doubled). The other path's
grad is now found among the records (the MLP's output grad, which the add passes through) and
added to the float64 value of each side (diff/other_paths.py): the bug reads BUG at the
embedding's grad, its correct twins rounding only."""
import pytest

from conftest import compare_planted


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, {c: ("residual_grad", c, ("--tp", "1,2"))
                                              for c in ("residual_ok", "residual_doubled",
                                                        "gathered_ok", "gathered_doubled")})


EMBED = "s0/backward/embed/grad_out#0/0"


def _embed_verdict(s):
    return next(f for f in s["degrees"]["2"]["findings"] if f.get("key") == EMBED)


@pytest.mark.parametrize("case", ["residual_doubled", "gathered_doubled"])
def test_a_doubled_input_grad_beside_a_residual_add_is_the_bug(runs, case):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert lead is not None and (lead["key"], lead["cause"]) == (EMBED, "sharding-bug"), lead
    v = lead["oracle"]
    # judged against the consumer's float64 backward PLUS the residual path: the reference is at
    # rounding distance from that sum (it was 1.5 - 153% - from the consumer's value alone)
    assert v["far"] and v["ref_err"] < 1e-5, v
    assert "residual add" in v.get("what", ""), v
    assert gate == 4 and "BUG" in stdout, stdout


@pytest.mark.parametrize("case", ["residual_ok", "gathered_ok"])
def test_its_correct_twin_is_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert "BUG" not in stdout and gate == 1, stdout


def test_the_first_divergence_is_judged_against_both_paths(runs):
    """gathered_ok: the forward is TP=1's bit for bit, so the embedding's grad is the first
    divergence with equal inputs (diff/oracle.apply), judged near the sum of both paths."""
    s, _, _ = runs["gathered_ok"]
    fd = s["degrees"]["2"]["first_divergence"]
    assert fd["key"] == EMBED, fd
    v = fd["oracle"]
    assert not v["far"] and v["ref_err"] < 1e-5 and "residual add" in v.get("what", ""), v


def test_a_reference_far_from_an_unexplained_single_consumer_value_is_not_judged():
    """No recorded grad explains the reference's distance from its consumer's float64 value:
    no verdict at all (never 'rounding' on a value the reference itself is far from)."""
    import torch

    from tpdiag.diff import other_paths

    class DD:
        pass

    g = torch.Generator().manual_seed(0)
    y = torch.randn(4, 8, generator=g)
    dd = DD()
    dd.rows = [{"key": "k1", "kind": "grad_out", "phase": "backward", "step": 0, "idx": 1},
               {"key": "k2", "kind": "grad_out", "phase": "backward", "step": 0, "idx": 2}]
    dd.oracle = {}
    unrelated = torch.randn(4, 8, generator=g)
    o = y.to(torch.float64) * 0.5  # the consumer's share only
    dd.tensors = {"k1": (unrelated, unrelated), "k2": (y, y * 3)}
    row = dd.rows[1]
    other_paths.attach(dd, row, o)
    assert "k2" not in dd.oracle and "not judged" in row["oracle_refused"], row
    # the other half recorded before it: explained, and the sum judges it
    dd.tensors["k1"] = (y * 0.5, y * 0.5)
    row.pop("oracle_refused")
    other_paths.attach(dd, row, o)
    assert row["other_path"] == "k1" and torch.equal(dd.oracle["k2"], y.to(torch.float64)), row
    assert other_paths.split(dd, row, y.to(torch.float64)) == (None, 0.0)
