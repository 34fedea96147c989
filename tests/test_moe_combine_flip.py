"""A wrong MoE combine behind a router flip reads BUG, not the flip (diff/choices_made.py).

tests/moe_combine_flip.py: a bf16 top-2 MoE split over the TP ranks by hand behind a row-parallel projection
whose rounding flips one token's experts at TP=2 (token 15 here); its twin renormalises the gates over each rank's own experts
(weights (1, 1) instead of (p, 1 - p) for a token whose experts sit on two ranks). The MoE's float64
re-execution from each side's inputs makes the router's unclear top-2 inside, so its far verdict was
`oracle_flip`, relabelled `router-flip` after the flip: on main at 958380df `compare --forward-only` read
`rounding only` and `gate --allow rounding` exited 0. Now each float64 run's choices, hashed, are held to
that side's own router output: both followed, the verdict judges the combine on every row - BUG, gate 4. The
correct twin reads rounding, gate 0.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import copied_run, relabelled_flip, run_cli, user_runs
from tpdiag.probes.float64 import module_oracle
from tpdiag.records.hashing import tensor_hash

FLIP = "s0/forward/moe.router/out#0/1"
MOE = "s0/forward/moe/out#0/0"
ARGS = ("--tp", "1,2", "--dtype", "bfloat16", "--forward-only", "--no-confirm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return user_runs(tmp_path_factory, "moe_combine_flip", ("combine_ok", "combine_local_bug"), *ARGS)


def test_a_wrong_combine_behind_a_router_flip_is_a_bug(runs):
    d, s, stdout = runs["combine_local_bug"]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip", found
    assert found[FLIP]["n_tokens"] == 1, found[FLIP]  # the near tie placed for one token
    f = found[MOE]  # was router-flip (not even listed in summary.json)
    assert f["cause"] == "sharding-bug" and f["bound_ratio"] > 1, f
    v = f["oracle"]
    assert v["far"] and v["own"] and "discrete" not in v, v
    assert v["choices_made"] == {"ops": ["aten::topk"], "choices": 1}, v
    assert s["class"] == "bug" and "BUG" in stdout, stdout[-2000:]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4  # was 0 (PASS) on main


def test_its_correct_twin_reads_rounding(runs):
    d, s, stdout = runs["combine_ok"]
    found = {f["key"]: f for f in s["degrees"]["2"]["findings"]}
    assert found[FLIP]["cause"] == "router-flip" and found[FLIP]["n_tokens"] == 1, found
    assert MOE not in found and not any(f["cause"] in ("sharding-bug", "unknown") for f in found.values()), found
    assert s["class"] == "rounding" and "BUG" not in stdout, stdout[-2000:]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_the_bug_relabelled_router_flip_does_not_pass(runs, tmp_path):
    d = copied_run(runs["combine_local_bug"][0], tmp_path)
    n = relabelled_flip(d)
    assert n == 2, n
    p = run_cli("gate", str(d), "--allow", "rounding")
    assert p.returncode == 2, p.stdout[-2000:]
    assert "which made each side's own choices" in p.stdout, p.stdout[-2000:]


# ---- the float64 mode's notes, on a module made here --------------------------------------------------

class _Pick(nn.Module):
    """Top-2 of four scores, the indices returned (a router); `compare`: a mask from a comparison too."""

    def __init__(self, compare=False):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))  # float32: a choice 4096 roundings apart is clear
        self.compare = compare

    def forward(self, x):
        z = x * self.w
        idx = z.topk(2, -1).indices
        return (idx, z * (z > 0)) if self.compare else idx


def test_the_float64_run_notes_the_indices_of_each_unclear_choice():
    near = torch.tensor([[3.0, 1.0, 1.000001, -2.0], [0.5, 4.0, 0.25, 0.500001]])
    out, notes = module_oracle(_Pick(), (near,), {})
    assert notes["discrete"] == ["aten::topk"] and notes["chosen"] == [tensor_hash(out)], notes
    assert torch.equal(out, torch.tensor([[0, 2], [1, 3]])), out
    clear = torch.tensor([[3.0, 1.0, -1.0, -2.0]])
    _, notes = module_oracle(_Pick(), (clear,), {})
    assert "chosen" not in notes and "discrete" not in notes, notes  # no rounding orders them otherwise
    _, notes = module_oracle(_Pick(compare=True), (near,), {})
    assert notes["chosen_untold"] == ["aten::gt"], notes  # a mask's choice holds no indices to hold


# ---- the rule, on records made here -------------------------------------------------------------------

_REF = torch.tensor([[2, 1], [2, 1], [2, 0]])  # the reference's router: top-2 per token
_THIS = torch.tensor([[2, 1], [2, 0], [2, 0]])  # this side's: token 1 flipped


def _dd(ref_chose=_REF, this_chose=_THIS, untold=False):
    """A module `moe` with a router child whose top-2 output differs on token 1 (the flip), and the notes
    of its float64 runs from the reference's and from this side's inputs: the indices each chose."""
    rows = [{"key": FLIP, "step": 0, "phase": "forward", "kind": "out", "module": "moe.router", "dtype": "int64",
             "rank_consistent": True},
            {"key": MOE, "step": 0, "phase": "forward", "kind": "out", "module": "moe", "call": 0,
             "dtype": "float32", "rank_consistent": True}]
    key = "s0/forward/moe/oracle#0"

    def notes(chose):
        n = {"discrete": ["aten::topk"], "chosen": [tensor_hash(chose)]}
        return {**n, "chosen_untold": ["aten::gt"]} if untold else n

    return SimpleNamespace(rows=rows, tensors={FLIP: (_REF, _THIS), MOE: (torch.zeros(3, 4), torch.ones(3, 4))},
                           oracle_notes={key: notes(ref_chose)}, oracle_notes_own={key: notes(this_chose)})


def test_choices_made_only_where_each_float64_run_chose_as_its_side():
    from tpdiag.diff import choices_made

    dd = _dd()
    assert choices_made.followed(dd, dd.rows[1]) == {"ops": ["aten::topk"], "choices": 1}
    # the float64 run from this side's inputs chose the reference's experts at the flipped token
    dd = _dd(this_chose=_REF)
    assert choices_made.followed(dd, dd.rows[1]) is None
    # ... or the reference's run chose this side's
    dd = _dd(ref_chose=_THIS)
    assert choices_made.followed(dd, dd.rows[1]) is None
    # a choice with no indices (a comparison) is held to no record
    dd = _dd(untold=True)
    assert choices_made.followed(dd, dd.rows[1]) is None
    # the reference's own float64 run not noted: not shown
    dd = _dd()
    dd.oracle_notes = {}
    assert choices_made.followed(dd, dd.rows[1]) is None
    # the router's output not held whole (hash capture): not shown
    dd = _dd()
    del dd.tensors[FLIP]
    assert choices_made.followed(dd, dd.rows[1]) is None


def _relabelled(made: bool):
    """A far `moe` output after the router flip, moved on the flipped token's row alone (where a wrong combine
    of that token shows, and a flip alone would too), its float64 verdict made on each side's own choices or
    not: what router.relabel_after leaves of it."""
    from tpdiag.diff import router
    from tpdiag.diff.judge import describe

    y_ref = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    y_n = y_ref.clone()
    y_n[1] += 0.5  # token 1: the flipped one
    v = {"far": True, "ratio": 9.0, "own": True, **({"choices_made": {"ops": ["aten::topk"], "choices": 1}}
                                                     if made else {"discrete": ["aten::topk"]})}
    dd = _dd()
    dd.tensors[MOE] = (y_ref, y_n)
    flip, row = dd.rows
    flip.update(idx=5, name="1", bitwise=False)
    row.update(idx=9, name="0", bitwise=False, beyond_bound=made, bound_ratio=9.0, oracle=v,
               **({} if made else {"oracle_flip": True}))
    f = describe(row, {"phase": "forward", "module": "moe", "op": None, "kind": "out", "name": "0", "step": 0,
                       "key": MOE, "cause": None, "max_abs": 0.5, "bound": None, "bound_ratio": 9.0})
    router.relabel_after([f], [row["idx"]], [{"cause": "router-flip", "idx": 5, "key": FLIP}], dd)
    return f


def test_a_verdict_on_each_sides_own_choices_is_no_flips_consequence():
    f = _relabelled(made=True)
    assert f["cause"] == "sharding-bug" and "after" not in f, f
    # the control: the same rows judged through a choice that may have flipped read the flip's
    f = _relabelled(made=False)
    assert f["cause"] == "router-flip" and f["after"] == FLIP, f
