"""A user's own TP step accumulating grads over 4 micro-batches, recorded with `tpdiag.capture` in
gloo worlds (tests/user_accum.py), then `tpdiag diff` as a user runs it.

Main at bb2f420: every such capture, TP=1's too, was refused by `tpdiag diff` ("record
s0/backward/head/param_grad#0/weight listed twice": each parameter's grad was recorded after every
backward under one key) - now each grad's last record of the step is kept (probes/piece_merge.py
last_grads). And the mistake `accum_tp` (the micro-batch count computed with the TP ranks as
data-parallel ones: every grad twice TP=1's) read `rounding only` (gate 1): the first divergence is
a harmless row-parallel reduction, and the 2x grads had no bound - the head's output grad was
named `vocab-parallel-softmax` by its layout. A record that is the reference's times one factor is
a sharding-bug now (diff/scale.py), with no bound needed."""
import json

import pytest

from conftest import run_cli
from user_worlds import capture_worlds


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("accum"), "user_accum", "step",
                          ((1, "none"), (2, "none"), (2, "accum_tp")))


def _diff(captures, tmp_path, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-none"), str(captures / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text()), p.stdout, run_cli("gate", str(out)).returncode


def test_an_accumulating_capture_keeps_each_grads_last_record(captures):
    from tpdiag.records.store import RecordSet

    rs = RecordSet(str(captures / "1-none"))
    keys = [m["key"] for m in rs.events]
    assert len(keys) == len(set(keys))
    grads = [m for m in rs.events if m["kind"] == "param_grad"]
    assert len(grads) == 6, [m["key"] for m in grads]  # embed, up (2), down (2), head: one each
    fwd = [m for m in rs.events if m["kind"] == "out" and m["module"] == "head"]
    assert len(fwd) == 4  # every micro-batch's forward is still its own record
    # each grad's record is the one after the last micro-batch's backward (the step's grad)
    last_call = [m["idx"] for m in rs.events if m["kind"] == "grad_out" and m["call"] == 3]
    assert last_call and all(g["idx"] > min(last_call) for g in grads), grads


def test_the_correct_loop_is_rounding_only(captures, tmp_path):
    s, stdout, gate = _diff(captures, tmp_path, "2-none")
    assert s["class"] == "rounding" and not s["degrees"]["2"]["findings"], s["degrees"]["2"]["findings"]
    assert "BUG" not in stdout and gate == 1


def test_micro_batches_counted_with_the_tp_ranks_are_a_bug(captures, tmp_path):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = _diff(captures, tmp_path, "2-accum_tp")
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == ("backward", "head", "grad_out",
                                                                             "sharding-bug"), lead
    assert lead["why"].startswith("every element is 2x the reference's"), lead
    assert "BUG at backward: head (grad_out 0): every element is 2x" in stdout, stdout
    assert gate == 4


def test_a_scale_is_told_from_rounding_noise():
    import torch

    from tpdiag.diff.scale import coherent_scale

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=g)
    assert coherent_scale(a, a * 2) == pytest.approx(2.0) and coherent_scale(a, a / 2) == pytest.approx(0.5)
    noisy = a * 2 + 1e-3 * torch.randn(64, 32, generator=g)  # a scale under rounding-sized noise
    assert coherent_scale(a, noisy) == pytest.approx(2.0, rel=1e-3)
    assert coherent_scale(a, a * 1.01) is None  # 1%: not called a scale
    # negative controls: noise the size of the values (any difference), other values, a scalar
    assert coherent_scale(a, a + torch.randn(64, 32, generator=g)) is None
    assert coherent_scale(a, torch.randn(64, 32, generator=g)) is None
    assert coherent_scale(a.flatten()[:4], a.flatten()[:4] * 2) is None
    assert coherent_scale(torch.zeros(64), torch.ones(64)) is None


def test_a_norm_one_element_carries_is_no_scale():
    """A tensor whose norm is one element's (a one-hot grad, an outlier activation) differs along
    itself whatever moved that element: its rounding past the first divergence is no one factor."""
    import torch

    from tpdiag.diff.scale import coherent_scale

    g = torch.Generator().manual_seed(0)
    one = torch.zeros(64)
    one[3] = 1.0
    moved = one.clone()
    moved[3] = 1.0625
    assert coherent_scale(one, moved) is None
    a = 0.01 * torch.randn(4096, generator=g)
    a[0] = 50.0  # an outlier: ~all of a's norm
    b = a * (1 + 4e-3 * torch.randn(4096, generator=g))  # rounding-sized noise everywhere
    b[0] = 53.0  # the outlier 6% off
    assert coherent_scale(a, b) is None
    # scaled whole by 2 where 6 elements carry the norm, or all of a's but the outlier: a scale
    spread = torch.zeros(64)
    spread[:6] = 1.0
    assert coherent_scale(spread, 2 * spread) == pytest.approx(2.0)
    assert coherent_scale(a[1:], 2 * a[1:]) == pytest.approx(2.0)


def test_without_the_scale_the_doubled_grads_read_as_rounding(captures, monkeypatch):
    """Negative control, in process: the same captures analysed with the scale check off."""
    from tpdiag.diff import pair_memo, scale
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.store import RecordSet

    def bugs():
        pair_memo.clear()  # measured pairs are remembered in process (diff/pair_memo.py)
        entry, _ = analyse_degree(RecordSet(str(captures / "1-none")), RecordSet(str(captures / "2-accum_tp")), "2")
        return [f for f in entry["findings"] if f["cause"] == "sharding-bug"]

    from tpdiag.diff import loss_first_order

    assert bugs()
    monkeypatch.setattr(scale, "MIN_SCALE", float("inf"))
    # the logits' grad row by row against how far the logits moved (diff/loss_first_order.grad_bound)
    # finds the 2x grads too (every row 1.0 of itself off): off here, the scale check alone is tested
    assert bugs()
    monkeypatch.setattr(loss_first_order, "GRAD_SPREAD", float("inf"))
    assert bugs() == []
