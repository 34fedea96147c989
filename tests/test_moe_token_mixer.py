"""A router flip carried into other token rows by a token mixer (tests/moe_token_mixer.py), and the gate's
re-derivation of router-flip labels (diff/flip_check.py).

tests/moe_token_mixer.py: a bf16 top-2 MoE split over the TP ranks by hand, one token's experts flipped at TP=2 by
the row-parallel MLP's rounding, then a causal token mixer (a running mean over the sequence). The mixer
carries the flipped token's change into every row of its sequence, so the router logits grad - each rank's
share - no longer adds up on the other rows of that sequence. On main at cc609201 the CORRECT `moe_mix_ok`
read BUG `rank-inconsistent-replica` at `moe.router.proj` grad_out 0 (gate 4, with --allow rounding too):
only the flipped row was left out of the share tests. Now the rows of the flipped tokens' sequences are
left out too (diff/flip_shares.py) and the other sequence's 8 rows are judged: within the band, `unknown`,
gate 1. The twin `moe_mix_late_bug` (the MLP after the mixer takes its residual from the entered tensor:
its grad counted twice at TP=2, on every row) stays BUG, gate 4 - and that BUG relabelled `router-flip`
in summary.json and in the second pass's summary passed `gate --allow rounding` (exit 0) on main; now
exit 2.
"""
import json

import pytest
import torch

from conftest import copied_run, run_cli, user_runs
from tpdiag.diff.flip_shares import Flips
from tpdiag.diff.judge import describe
from tpdiag.diff.partials import partial_sum

GRAD = "s0/backward/moe.router.proj/grad_out#0/0"
FLIP = "s0/forward/moe.router/out#0/1"
ARGS = ("--tp", "1,2", "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return user_runs(tmp_path_factory, "moe_token_mixer", ("moe_mix_ok", "moe_mix_late_bug"), *ARGS)


def _gate(d, *more):
    return run_cli("gate", str(d), *more)


def test_a_correct_moe_behind_a_token_mixer_reads_no_bug(runs):
    d, s, stdout = runs["moe_mix_ok"]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip", found
    assert found[GRAD]["cause"] == "unknown", found[GRAD]  # was rank-inconsistent-replica (BUG)
    why = found[GRAD]["why"]
    assert why.startswith("a router flip changed token rows 3 (1 of 16") and "sequence(s) 0 (1 x 8 rows)" in why, why
    assert "on the other 8 rows" in why, why
    assert s["class"] == "unknown" and "BUG" not in stdout, stdout[-2000:]
    assert not any(f["cause"] in ("rank-inconsistent-replica", "sharding-bug") for f in found.values()), found
    assert _gate(d).returncode == 1 and _gate(d, "--allow", "rounding").returncode == 1


def test_its_twin_with_a_bug_after_the_mixer_stays_a_bug(runs):
    d, s, stdout = runs["moe_mix_late_bug"]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip", found
    assert found[GRAD]["cause"] == "rank-inconsistent-replica", found[GRAD]
    assert s["class"] == "bug", s["class"]
    assert _gate(d, "--allow", "rounding").returncode == 4


def _relabel(path):
    s = json.loads(path.read_text())
    n = 0
    for e in s["degrees"].values():
        for f in e.get("findings") or ():
            if f.get("cause") in ("rank-inconsistent-replica", "sharding-bug"):
                f["cause"], n = "router-flip", n + 1
    if s.get("class") == "bug":
        s["class"] = "rounding"
    path.write_text(json.dumps(s))
    return n


def test_a_bug_relabelled_router_flip_in_both_summaries_does_not_pass(runs, tmp_path):
    d = copied_run(runs["moe_mix_late_bug"][0], tmp_path)
    second = json.loads((d / "summary.json").read_text())["second_pass"]["dir"].rstrip("/").rpartition("/")[2]
    assert _relabel(d / "summary.json") == 2 and _relabel(d / second / "summary.json") >= 1
    p = _gate(d, "--allow", "rounding")
    assert p.returncode == 2, p.stdout[-2000:]  # was 0 (PASS) on main
    assert "has cause 'router-flip', but its records re-diffed give" in p.stdout, p.stdout[-2000:]


def test_the_correct_run_is_not_called_edited(runs):
    # the honest runs read by the new check: no exit 2 (its router-flip labels are the records')
    for func in ("moe_mix_ok", "moe_mix_late_bug"):
        assert _gate(runs[func][0]).returncode in (1, 4), func


# ---- the rows, on a pair of shares made here ---------------------------------------------------------

def _assignment(n=16, flipped=(3,)):
    a = torch.stack([torch.full((n,), 2), torch.ones(n, dtype=torch.long)], -1)
    b = a.clone()
    for t in flipped:
        b[t, 1] = 0
    row = {"key": FLIP, "step": 0, "phase": "forward", "kind": "out", "module": "moe.router", "dtype": "int64",
           "bitwise": False}
    return row, a, b


def _mixed(seed=0, n=16, s=8):
    """(reference, [rank 0's share, rank 1's share]) of a correct float32 split; token 3's row moved as a
    flip moves it, and every other row of its sequence (rows 0-7) moved as a token mixer carries it."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, 4, generator=g)
    c0 = (ref.double() * torch.rand(n, 4, generator=g).double()).float()
    c1 = (ref.double() - c0.double()).float()
    c0[3] += 0.5
    c0[:s] += 0.05 * torch.randn(s, 4, generator=g)
    return ref, [c0, c1]


def _judged(ref, copies, seq_len):
    fl = Flips()
    if seq_len is not None:
        ids = torch.zeros(ref.shape[0] // seq_len, seq_len, dtype=torch.long)
        fl.note({"key": "s0/init/model/batch#0/labels", "kind": "batch", "step": 0}, ids, ids)
    fl.note(*_assignment(ref.shape[0]))
    row = {"key": GRAD, "idx": 9, "step": 0, "phase": "backward", "module": "moe.router.proj", "kind": "grad_out",
           "name": "0", "rank_consistent": False, "bitwise": False}
    partial_sum(row, ref, copies)
    fl.mark(row, ref, copies)
    f = describe(row, {"phase": "backward", "module": "moe.router.proj", "op": None, "kind": "grad_out",
                       "name": "0", "step": 0})
    return row, f


def test_rows_a_mixer_reached_are_left_out_with_their_sequence():
    ref, copies = _mixed()
    row, f = _judged(ref, copies, None)  # the negative control: no batch recorded - the flipped row alone
    assert "rank_partial_flip" not in row and f["cause"] == "rank-inconsistent-replica", (row, f)
    row, f = _judged(ref, copies, 8)
    m = row["rank_partial_flip"]
    assert m["sequences"] == [0] and m["rows_left"] == 8 and not m["near"], m
    assert f["cause"] == "router-flip" and "sequence(s) 0 (1 x 8 rows)" in f["why"], f


def test_a_wrong_share_in_a_sequence_no_flip_touched_stays_a_bug():
    ref, copies = _mixed()
    copies[1][12, 2] += 0.25 * float(ref.abs().max())  # row 12: sequence 1, no flip there
    row, f = _judged(ref, copies, 8)
    assert "rank_partial_flip" not in row and f["cause"] == "rank-inconsistent-replica", (row, f)


@pytest.mark.parametrize("how", ["one_sequence", "other_length"])
def test_where_no_sequence_is_left_or_told_the_bug_stands(how):
    ref, copies = _mixed()
    row, f = _judged(ref, copies, 16 if how == "one_sequence" else 5)
    assert "rank_partial_flip" not in row and f["cause"] == "rank-inconsistent-replica", (how, row, f)


def test_the_gate_check_reads_the_rows():
    from tpdiag.diff.flip_check import problem

    flip = {"key": FLIP, "idx": 5, "bitwise": False, "rank_consistent": True, "phase": "forward", "kind": "out",
            "module": "moe.router", "dtype": "int64"}
    before = {"key": "s0/forward/mlp/out#0/0", "idx": 2, "bitwise": False, "rank_consistent": True,
              "phase": "forward", "kind": "out", "module": "mlp", "dtype": "bfloat16"}
    grad = {"key": GRAD, "idx": 9, "bitwise": False, "rank_consistent": False, "phase": "backward",
            "kind": "grad_out", "module": "moe.router.proj", "dtype": "bfloat16"}
    entry = {"first_divergence": {"key": before["key"], "cause": "row-parallel-reduction"},
             "findings": [{"key": FLIP, "cause": "router-flip"}, {"key": GRAD, "cause": "router-flip"}]}
    assert "re-diffed give a record whose ranks' copies differ" in problem("2", entry, [before, flip, grad])
    marked = dict(grad, rank_partial_flip={"near": False})
    assert problem("2", entry, [before, flip, marked]) is None
    assert problem("2", entry, [before, flip, dict(grad, rank_partial_flip={"near": True})]) is not None
    # the flip itself: router-flip only after an earlier divergent record
    assert "no divergent record before it" in problem("2", entry, [dict(before, bitwise=True), flip, marked])


def test_under_hash_capture_too(tmp_path_factory, tmp_path):
    # pass 1 has the grad's per-rank hashes only; the region pass reads it whole (runner/drill_merge._judged_whole)
    d = tmp_path_factory.mktemp("hash") / "run"
    p = run_cli("compare", "--model", "py:tests/moe_token_mixer.py:moe_mix_ok", *ARGS, "--capture", "hash", "--out", str(d))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.loads((d / "summary.json").read_text())
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[GRAD]["cause"] == "unknown" and found[GRAD]["from"] == "second pass", found[GRAD]
    assert "sequence(s) 0 (1 x 8 rows)" in found[GRAD]["why"], found[GRAD]
    assert _gate(d, "--allow", "rounding").returncode == 1
    # the unknown relabelled router-flip in every summary: was exit 0 on main
    t = copied_run(d, tmp_path)
    for f in (t / "summary.json", *sorted(t.glob("region/**/summary.json"))):
        s = json.loads(f.read_text())
        for e in s["degrees"].values():
            for g in e.get("findings") or ():
                if g.get("cause") == "unknown" and ".router" in str(g.get("module")):
                    g["cause"] = "router-flip"
        s["class"] = "rounding" if s.get("class") == "unknown" else s.get("class")
        f.write_text(json.dumps(s))
    p = _gate(t, "--allow", "rounding")
    assert p.returncode == 2 and "has cause 'router-flip', but its records re-diffed give" in p.stdout, p.stdout[-2000:]
