"""A real forward bug after a router flip (tests/moe_flip_forward.py) is not the flip's consequence (diff/flip_rows.py).

tests/moe_flip_forward.py: a bf16 top-2 MoE split over the TP ranks by hand, token 14's experts flipped at TP=2 by the
row-parallel MLP's rounding before it, then a row-parallel MLP whose twin adds its replicated bias at every rank
(counted twice at TP=2, on every token row). The second pass judges that MLP's output 8.6x beyond its float64
re-execution from this side's own inputs; router.relabel_after read it `router-flip` (it comes after the flip),
so on main at bedbdc47 `compare --forward-only` called the run `rounding only` and `gate --allow rounding`
exited 0. Now the rows the flip cannot reach (the other sequence's 8 rows: no op after the MoE is known not to
mix tokens, so the flipped token's sequence is left out too) are judged by the same float64 verdict: far, so
the finding stays `sharding-bug`, gate 4. The correct twin reads no BUG.
"""
from types import SimpleNamespace

import pytest
import torch

from conftest import copied_run, relabelled_flip, run_cli, user_runs
from tpdiag.diff import flip_rows, router
from tpdiag.diff.judge import describe

FLIP = "s0/forward/moe.router/out#0/1"
MLP2 = "s0/forward/mlp2/out#0/0"
ARGS = ("--tp", "1,2", "--dtype", "bfloat16", "--forward-only")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return user_runs(tmp_path_factory, "moe_flip_forward", ("moe_flip_ok", "moe_flip_bias_bug"), *ARGS)


def test_a_forward_bug_after_a_router_flip_stays_a_bug(runs):
    d, s, stdout = runs["moe_flip_bias_bug"]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip", found
    assert found[MLP2]["cause"] == "sharding-bug", found  # was router-flip (not even listed in summary.json)
    m = found[MLP2]["flip_rows"]
    assert m["tokens"] == [14] and m["sequences"] == [1] and m["rows_left"] == 8 and not m["confined"], m
    assert m["ratio"] > 1, m
    assert s["class"] == "bug" and "BUG" in stdout, stdout[-2000:]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4  # was 0 (PASS) on main


def test_its_correct_twin_reads_no_bug(runs):
    d, s, stdout = runs["moe_flip_ok"]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip", found
    assert not any(f["cause"] in ("sharding-bug", "rank-inconsistent-replica") for f in found.values()), found
    assert s["class"] != "bug" and "BUG" not in stdout, stdout[-2000:]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_the_bug_relabelled_router_flip_in_both_summaries_does_not_pass(runs, tmp_path):
    d = copied_run(runs["moe_flip_bias_bug"][0], tmp_path)
    n = relabelled_flip(d, "flip_rows")
    assert n == 2, n
    p = run_cli("gate", str(d), "--allow", "rounding")
    assert p.returncode == 2, p.stdout[-2000:]
    assert "the token rows the router flip cannot reach" in p.stdout, p.stdout[-2000:]


# ---- the rows, on records made here -------------------------------------------------------------------

def _dd(moved_rows, n=16, s=8, flipped=(3,), seq=True):
    """A degree's diff: a batch [n/s, s], a top-2 assignment with `flipped` tokens' experts changed, and a
    float32 forward output [n/s, s, 4] judged far by its float64 re-execution from this side's own inputs,
    this side moved (beyond rounding) on `moved_rows`."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(n // s, s, dtype=torch.long)
    a = torch.stack([torch.full((n,), 2), torch.ones(n, dtype=torch.long)], -1)
    b = a.clone()
    for t in flipped:
        b[t, 1] = 0
    o = torch.randn(n // s, s, 4, generator=g, dtype=torch.float64)
    y_ref = o.float()
    y_n = y_ref.clone()
    y_n.view(n, 4)[list(moved_rows)] += 0.5
    rows = ([{"key": "s0/init/model/batch#0/labels", "idx": 1, "kind": "batch", "step": 0, "phase": "init"}]
            if seq else [])
    rows += [{"key": FLIP, "idx": 5, "step": 0, "phase": "forward", "kind": "out", "module": "moe.router",
              "name": "1", "dtype": "int64", "bitwise": False, "rank_consistent": True},
             {"key": MLP2, "idx": 9, "step": 0, "phase": "forward", "kind": "out", "module": "mlp2", "name": "0",
              "dtype": "float32", "bitwise": False, "rank_consistent": True, "beyond_bound": True,
              "bound_ratio": 9.0, "oracle": {"far": True, "ratio": 9.0, "own": True}}]
    tensors = {FLIP: (a, b), MLP2: (y_ref, y_n)}
    if seq:
        tensors[rows[0]["key"]] = (ids, ids)
    return SimpleNamespace(rows=rows, tensors=tensors, oracle={}, oracle_own={MLP2: o})


def _relabelled(dd, with_rows=True):
    row = dd.rows[-1]
    f = describe(row, {"phase": "forward", "module": "mlp2", "op": None, "kind": "out", "name": "0", "step": 0,
                       "key": MLP2, "cause": None, "max_abs": 0.5, "bound": None, "bound_ratio": 9.0})
    assert f["cause"] == "sharding-bug", f
    flips = [{"cause": "router-flip", "idx": 5, "key": FLIP}]
    router.relabel_after([f], [row["idx"]], flips, dd if with_rows else None)
    return f


def test_a_difference_on_the_flipped_rows_alone_is_the_flips():
    f = _relabelled(_dd([3]))
    assert f["cause"] == "router-flip" and f["after"] == FLIP, f
    assert f["flip_rows"]["confined"] and f["flip_rows"]["bitwise"] and "sequences" not in f["flip_rows"], f


def test_a_difference_on_every_row_stays_a_bug():
    f = _relabelled(_dd(range(16)))
    assert f["cause"] == "sharding-bug" and "after" not in f and not f["flip_rows"]["confined"], f
    # the negative control: without the rows (today's relabelling) it read router-flip
    assert _relabelled(_dd(range(16)), with_rows=False)["cause"] == "router-flip"


def test_a_difference_carried_through_the_flipped_sequence_is_the_flips():
    f = _relabelled(_dd(range(8)))  # rows 0-7: token 3's sequence, as a token mixer carries it
    assert f["cause"] == "router-flip" and f["flip_rows"]["sequences"] == [0], f
    assert f["flip_rows"]["rows_left"] == 8 and f["flip_rows"]["confined"], f
    # ... but a row of the other sequence moved too: a bug
    assert _relabelled(_dd([*range(8), 12]))["cause"] == "sharding-bug"


def test_where_the_rows_are_not_told_the_relabelling_stands():
    # no batch recorded: the sequences are not told, and every row moved - today's relabelling (module doc)
    f = _relabelled(_dd([*range(8)], seq=False))
    assert f["cause"] == "unknown" and f["flip_rows"]["confined"] is None, f  # fail closed: not router-flip
    assert "no batch record says which rows" in f["why"], f
    f = _relabelled(_dd([3], seq=False))  # ... where the flipped row alone moved, told all the same
    assert f["cause"] == "router-flip" and f["flip_rows"]["confined"], f
    dd = _dd(range(16))
    dd.tensors[MLP2] = tuple(t.reshape(4, 16) for t in dd.tensors[MLP2])  # 4 rows: not the 16 tokens
    f = _relabelled(dd)
    assert f["cause"] == "router-flip" and "flip_rows" not in f, f
    assert flip_rows.confined(dd, dd.rows[-1], flip_rows.flips_of(dd)) is None
