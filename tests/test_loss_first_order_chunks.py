"""diff/loss_first_order works on float64 pieces of rows (CHUNK), not whole tensors: a 2048 x 128k
logits pair made 4 x 2.1 GB of float64 at once. The pieces must give the verdicts and bounds of the
whole-tensor pass: here a bug (a grad moved by 1e-3 of itself while its input moved by 1e-7) and a
reordering, judged with pieces of 3 rows against one piece."""
import types

import pytest
import torch

from tpdiag.diff import loss_first_order as lfo


def _dd(bug: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(10, 64, generator=g)
    z2 = z1 + 1e-7 * torch.randn(10, 64, generator=g)
    g1 = torch.softmax(z1, -1) - torch.nn.functional.one_hot(torch.arange(10) % 64, 64).float()
    g2 = torch.softmax(z2, -1) - torch.nn.functional.one_hot(torch.arange(10) % 64, 64).float()
    if bug:
        g2 = g2 * (1 + 1e-3 * torch.rand(10, 1, generator=g))
    la, lb = torch.tensor(2.5), torch.tensor(2.5 + (0.1 if bug else 1e-8))
    base = {"step": 0, "call": 0, "bitwise": False, "max_abs": 1e-3}
    rows = [dict(base, key="z", phase="forward", module="model", kind="out", name="0"),
            dict(base, key="g", phase="backward", module="model", kind="grad_out", name="0"),
            dict(base, key="L", phase="loss", module="loss", kind="loss", name="loss")]
    dd = types.SimpleNamespace(tensors={"z": (z1, z2), "g": (g1, g2), "L": (la, lb)})
    return dd, rows


def _judge(chunk, bug, monkeypatch):
    monkeypatch.setattr(lfo, "CHUNK", chunk)
    dd, rows = _dd(bug)
    lfo.first_order_bound(dd, 0, rows)
    lfo.grad_bound(dd, rows)
    return [(r.get("beyond_bound"), r.get("bound_ratio")) for r in rows]


@pytest.mark.parametrize("bug", [True, False])
def test_pieces_of_rows_judge_as_the_whole_tensor(bug, monkeypatch):
    whole = _judge(1 << 30, bug, monkeypatch)
    pieces = _judge(3 * 64, bug, monkeypatch)  # 3 rows a piece: 4 pieces, the last short
    assert [w[0] for w in whole] == [p[0] for p in pieces]
    for (_, a), (_, b) in zip(whole, pieces):
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, rel=1e-9))
    # the cases judge what they stand for: the grad row check fires on the bug only
    assert whole[1][0] is (True if bug else None)
    assert whole[2][0] is bug
