"""A correct RowwiseParallel whose rank partials cancel (tests/models/planted/cancel_rowwise.py):
in bf16 each rank's partial, 30x the output, is rounded before the all-reduce - a rounding TP=1's
one GEMM never makes. The float64 oracle scaled by TP=1's own error alone called it a BUG
(81c200d: `forward: mlp.down`, then `forward: mlp`, 2.2x beyond rounding, gate 4); its level now
includes one rounding of the partials (diff/rank_partials.py), for the Linear and for the block
around it, and past the first divergence (the own-input verdict of a second such block, which read
BUG at `forward: mlp2.down`, 2.4x). The same arithmetic still calls a wrong sum of those partials
far."""
import pytest
import torch

from conftest import compare_planted


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, {c: ("cancel_rowwise", c, ("--tp", "1,2", "--dtype", "bfloat16"))
                                              for c in ("cancel_rowwise", "cancel_rowwise_deep")})


@pytest.mark.parametrize("case", ["cancel_rowwise", "cancel_rowwise_deep"])
def test_cancelling_rank_partials_in_bf16_are_rounding(runs, case):
    s, stdout, gate = runs[case]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d.get("findings"), d
    fd = d["first_divergence"]
    assert (fd["module"], fd["cause"]) == ("blocks.0.down", "row-parallel-reduction"), fd
    assert "BUG" not in stdout and gate == 1, stdout


def _cancelling(k=30.0, n=64, world=2):
    g = torch.Generator().manual_seed(0)
    h = torch.relu(torch.randn(16, n // 2, generator=g))
    x = torch.cat([h, h], -1).to(torch.bfloat16)
    a = torch.randn(32, n // 2, generator=g) / n ** 0.5
    w = torch.cat([k * a, -k * a + torch.randn(32, n // 2, generator=g) / n ** 0.5], 1).to(torch.bfloat16)
    o = x.double() @ w.double().T
    y1 = (x.float() @ w.float().T).to(torch.bfloat16)  # TP=1: one accumulation, one rounding
    parts = [(x[:, c].float() @ w[:, c].float().T).to(torch.bfloat16) for c in torch.arange(n).chunk(world)]
    return x, w, o, y1, parts


def test_the_partials_level_judges_a_sum_and_a_wrong_sum():
    from tpdiag.diff.oracle import judge
    from tpdiag.diff.rank_partials import partials_norm

    x, w, o, y1, parts = _cancelling()
    right = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    p = partials_norm(x, w, 2)
    assert judge(y1, right, o)["far"]  # the old level: a correct sum read as a bug
    assert not judge(y1, right, o, p)["far"]
    # wrong sums are still far: rank 1's partial dropped, or added twice
    assert judge(y1, parts[0], o, p)["far"]
    assert judge(y1, (parts[0].float() + 2 * parts[1].float()).to(torch.bfloat16), o, p)["far"]
    # without cancellation the level is the output's own rounding (nothing widened)
    x2, w2, o2, y2, _ = _cancelling(k=0.0)
    assert partials_norm(x2, w2, 2) < 2 * float(torch.linalg.vector_norm(o2))
