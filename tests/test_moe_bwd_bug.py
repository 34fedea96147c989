"""A wrong BACKWARD past the first divergence, through a module that makes a discrete choice
(tests/models/planted/moe_bwd_bug.py: a top-2 MoE behind a hand-rolled row-parallel MLP whose shared
expert reads the tokens after the all-reduce-the-grad entry, so its input grad is counted TP times -
the forward exactly right - and the twin whose shared expert reads them before it).

On main at 85e6ea9 the MLP's output grad (the MoE's input grad), judged by the MoE's float64 backward
on this side's own inputs (0.47 off, ratio ~5e5), was dropped because that backward re-executes a
top-k: no finding, no unknown - `compare` read `rounding only` and `gate --allow rounding` exited 2
("that record moved 0.473 ... edited after the run"). The float64 forward it starts from reproduced
each run's forward row by row (diff/choices_followed.py), so it made the runs' choices: now a BUG,
gate 4. Where that is not shown, it is an `unknown` finding (gate 1), never dropped. The twin stays
rounding only, gate 0. The same mistake was in moe_late_bug.py's twin (its 0.47, read by hdisc17 as a
flaw of the float64 backward); that twin now reads the shared expert's tokens before _Copy.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import run_cli
from tpdiag.records.keys import record_key

SPEC = "py:tests/models/planted/moe_bwd_bug.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("shared_through_enter", "shared_beside"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout,
                     run_cli("gate", str(d), "--allow", "rounding"))
    return out


def test_a_wrong_grad_out_of_a_top_k_moe_backward_is_a_bug(runs):
    s, stdout, gate = runs["shared_through_enter"]
    e = s["degrees"]["2"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    got = [f for f in e["findings"] if (f["phase"], f["module"], f["kind"]) == ("backward", "dense", "grad_out")]
    assert len(got) == 1, e["findings"]
    f = got[0]
    assert f["cause"] == "sharding-bug", f
    v = f["oracle"]
    assert v["far"] and v["own"] and v["ratio"] > 1e4 and not v.get("discrete"), v
    # the float64 backward made the runs' top-k choices: its forward reproduced both runs row by row
    assert v["choices_followed"] == {"ops": ["aten::topk"], "forward": "s0/forward/sparse/out#0/0"}, v
    assert s["class"] == "bug" and "rounding only" not in stdout, (s["class"], stdout[-1500:])
    assert "it made the runs' own choices at aten::topk" in stdout, stdout[-1500:]
    assert gate.returncode == 4 and "cause sharding-bug" in gate.stdout, gate.stdout + gate.stderr


def test_the_twin_stays_rounding_only(runs):
    s, stdout, gate = runs["shared_beside"]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e["findings"], e["findings"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    assert gate.returncode == 0, gate.stdout + gate.stderr


TOPK = ["aten::topk"]


def _dd(y_ref, y_n, o_n, o_ref=None, verdict=None):
    key = "s0/forward/sparse/out#0/0"
    row = {"key": key, "phase": "forward", "kind": "out", "module": "sparse", "step": 0, "call": 0}
    if verdict is not None:
        row["oracle"] = verdict
    # what the reference world noted of the forward's float64 re-execution: the top-k it read
    notes = {record_key(0, "forward", "sparse", "oracle", 0): {"discrete": ["aten::topk"]}}
    return SimpleNamespace(rows=[row], tensors={key: (y_ref, y_n)}, oracle_own={key: o_n},
                           oracle={} if o_ref is None else {key: o_ref}, oracle_notes=notes)


def test_a_forward_row_a_flip_moved_is_no_evidence_of_the_runs_choices():
    from tpdiag.diff.choices_followed import forward_followed

    g = torch.Generator().manual_seed(0)
    o = torch.randn(16, 32, generator=g, dtype=torch.float64)
    y = o.float()  # each side rounded once from the float64 value
    near = {"far": False, "ratio": 0.1}
    assert forward_followed(_dd(y, y.clone(), o, o), "sparse", 0, TOPK) == "s0/forward/sparse/out#0/0"
    assert forward_followed(_dd(y, y.clone(), o, verdict=near), "sparse", 0, TOPK) == "s0/forward/sparse/out#0/0"
    # a token routed to another expert at this side: its row O(1) off, the other 15 rows exact
    flipped = y.clone()
    flipped[5] += 0.5 * torch.randn(32, generator=g)
    assert forward_followed(_dd(y, flipped, o, o), "sparse", 0, TOPK) is None
    # ... or a few hundred roundings off in one row (not a reordering of that row's sums either)
    off = y.clone()
    off[3] *= 1 + 2.0 ** -16
    assert forward_followed(_dd(y, off, o, o), "sparse", 0, TOPK) is None
    # the reference's value kept as norms only: its forward verdict must be near, and not a flip's
    assert forward_followed(_dd(y, y.clone(), o), "sparse", 0, TOPK) is None
    assert forward_followed(_dd(y, y.clone(), o, verdict={"far": True, "ratio": 9.0}), "sparse", 0, TOPK) is None
    # no float64 value of this side's own forward: nothing shows its choices
    d = _dd(y, y.clone(), o, o)
    d.oracle_own = {}
    assert forward_followed(d, "sparse", 0, TOPK) is None
    assert forward_followed(_dd(y, y.clone(), o, o), "dense", 0, TOPK) is None
    # a choice only the backward read (a max whose values the forward used, its grad routed to the
    # argmax): a flip of it moves no forward row, so the rows show nothing of it
    assert forward_followed(_dd(y, y.clone(), o, o), "sparse", 0, TOPK + ["aten::max"]) is None
