"""Shares of an activation grad behind a router flip are judged on the token rows the flip left alone
(diff/flip_shares.py).

tests/models/planted/moe_zloss_flip.py: a bf16 top-2 MoE split over the TP ranks by hand, a near tie
flipping one token's experts at TP=2 (router-flip, rounding). `zloss_share` is CORRECT, `zloss_every_rank`
counts the z-loss twice at TP=2. The router's logits grad is each rank's share; the flipped token's row
is another computation, no share of the reference's. On main at 8ba4ac84 BOTH read BUG
`rank-inconsistent-replica` at `moe.router.proj` grad_out 0 (gate 4): a false BUG on the correct twin.
Now the other 15 rows are judged: they add up only within the bf16 share band (the z-loss counted twice
moves them by 2.9e-4, the band is 4.3e-4), so both read `unknown` (gate 1) - never BUG on the correct
twin, never rounding on the bug twin. The synthetic cases below pin the other branches: rows that add up
element by element read `router-flip`, a wrong share on an unflipped row stays BUG, and where the
records cannot tell the rows (a hash-captured flip, another row count) nothing changes.
"""
import json

import pytest
import torch

from conftest import planted_shared, run_cli
from tpdiag.diff.flip_shares import Flips
from tpdiag.diff.judge import describe
from tpdiag.diff.partials import partial_sum

GRAD = "s0/backward/moe.router.proj/grad_out#0/0"
FLIP = "s0/forward/moe.router/out#0/1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for func in ("zloss_share", "zloss_every_rank"):
        d, stdout = planted_shared(tmp_path_factory, "moe_zloss_flip", func, "--tp", "1,2", "--dtype", "bfloat16")
        out[func] = (json.loads((d / "summary.json").read_text()), stdout, run_cli("gate", str(d)).returncode)
    return out


@pytest.mark.parametrize("func", ["zloss_share", "zloss_every_rank"])
def test_a_share_grad_behind_a_router_flip_is_judged_on_the_other_rows(runs, func):
    s, stdout, gate = runs[func]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip", found  # the flip: token 3 chose other experts
    assert found[GRAD]["cause"] == "unknown", found  # was rank-inconsistent-replica (BUG) on both
    assert found[GRAD]["why"].startswith("a router flip changed token rows 3 (1 of 16"), found[GRAD]
    assert "on the other 15 rows" in found[GRAD]["why"] and "shares not judged" in found[GRAD]["why"]
    assert s["class"] == "unknown" and "BUG" not in stdout, stdout[-2000:]
    assert gate == 1  # not judged: the gate fails both, passes neither


# ---- the branches, on a pair of shares made here ------------------------------------------------

def _assignment(flipped_tokens=(3,), n=16):
    a = torch.stack([torch.full((n,), 2), torch.ones(n, dtype=torch.long)], -1)
    b = a.clone()
    for t in flipped_tokens:
        b[t, 1] = 0  # the second place went to expert 0 instead of 1
    row = {"key": "s0/forward/moe.router/out#0/1", "step": 0, "phase": "forward", "kind": "out",
           "module": "moe.router", "dtype": "int64", "bitwise": False}
    return row, a, b


def _shares(seed=0, n=16):
    """(reference, [rank 0's share, rank 1's share]) of a correct float32 split: they add up within
    roundings - then token 3's row of rank 0's share moved as a flip moves it (another computation)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, 4, generator=g)
    c0 = (ref.double() * torch.rand(n, 4, generator=g).double()).float()
    c1 = (ref.double() - c0.double()).float()
    c0[3] += 0.5
    return ref, [c0, c1]


def _judged(ref, copies, flips):
    row = {"key": GRAD, "idx": 9, "step": 0, "phase": "backward", "module": "moe.router.proj", "kind": "grad_out",
           "name": "0", "rank_consistent": False, "bitwise": False}
    partial_sum(row, ref, copies)
    flips.mark(row, ref, copies)
    f = describe(row, {"phase": "backward", "module": "moe.router.proj", "op": None, "kind": "grad_out",
                       "name": "0", "step": 0})
    return row, f


def _flips(*rows):
    fl = Flips()
    for r in rows:
        fl.note(*r) if isinstance(r, tuple) else fl.note(r)
    return fl


def test_the_flipped_row_alone_read_a_replica_bug():
    # the negative control: the same shares with no flip noted - what every share grad behind a flip read
    ref, copies = _shares()
    row, f = _judged(ref, copies, Flips())
    assert f["cause"] == "rank-inconsistent-replica" and "rank_partial_flip" not in row, (row, f)


def test_the_other_rows_adding_up_read_the_flips_consequence():
    ref, copies = _shares()
    row, f = _judged(ref, copies, _flips(_assignment()))
    assert row["rank_partial_flip"]["tokens"] == [3] and not row["rank_partial_flip"]["near"], row
    assert f["cause"] == "router-flip" and "add up to the reference's value within roundings" in f["why"], f


def test_a_wrong_share_on_an_unflipped_row_stays_a_bug():
    ref, copies = _shares()
    copies[1][5, 2] += 0.25 * float(ref.abs().max())  # beyond the band
    row, f = _judged(ref, copies, _flips(_assignment()))
    assert "rank_partial_flip" not in row and f["cause"] == "rank-inconsistent-replica", (row, f)


@pytest.mark.parametrize("how", ["hash", "other_count", "other_step", "order_only"])
def test_where_the_records_cannot_tell_the_rows_the_bug_stands(how):
    ref, copies = _shares()
    fr, a, b = _assignment()
    if how == "hash":  # which tokens flipped is not recorded: no rows can be told
        flips = _flips((fr, a, b), dict(fr, key="s0/forward/moe2.router/out#0/1"))
    elif how == "other_count":  # the router counted 8 tokens: these 16 rows are not its tokens
        flips = _flips(_assignment(n=8))
    elif how == "other_step":
        flips = _flips((dict(fr, step=1), a, b))
    else:  # the same experts in another order: no token changed its experts
        flips = _flips((fr, a, a.flip(-1)))
    row, f = _judged(ref, copies, flips)
    assert "rank_partial_flip" not in row and f["cause"] == "rank-inconsistent-replica", (how, row, f)


def test_only_an_activation_grad_of_the_backward_is_read_so():
    ref, copies = _shares()
    flips = _flips(_assignment())
    for phase, kind in (("forward", "out"), ("backward", "param_grad")):
        row = {"key": f"s0/{phase}/moe.router.proj/{kind}#0/0", "step": 0, "phase": phase, "kind": kind,
               "rank_consistent": False}
        flips.mark(row, ref, copies)
        assert "rank_partial_flip" not in row, row
