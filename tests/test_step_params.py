"""A module judged past step 0 is judged by the function THIS side computed (helper hstep16), at
`--steps 2 --no-anchor` (re-anchored, the default, step 1 reads the reference's weights at both sides).

From step 1 on the parameters a forward reads are each side's own update: they differ by rounding at
TP > 1, by a bug's size after a broken update. The own-input pass re-executes the reference's module
in float64 on this side's inputs - this side's function only where its parameters are this side's
too. diff/equal_inputs.params_equal checked the root ("model") by name alone: its children are named
"embed", "block", not "model.*", so at step 1 the root's float64 backward, run from the reference's
weights, judged the grads it taps as if they were this side's (tests/models/planted/two_paths.py
gate_f: its block's step-1 output grad was listed as following the gate's, its s1 forward output a
sharding bug, and gate.proj's step-1 grad was not judged). Now every parameter of the judging
module's subtree is checked, and where they differ the second pass ships this side's (diff/
own_params.py) and the reference world re-executes from them (probes/own_params.py): gate_f reads
BUG at step 1 too, judged on its own; the correct twin gate_ok reads rounding with nothing left
unjudged."""
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import run_cli

SPEC = "py:tests/models/planted/two_paths.py:"


def _row(key_step, phase, module, kind, bitwise, name="weight", call=0):
    return {"step": key_step, "phase": phase, "module": module, "kind": kind, "bitwise": bitwise,
            "call": call, "name": name, "key": f"s{key_step}/{phase}/{module}/{kind}#{call}/{name}"}


def _dd(*extra):
    rows = [_row(1, "forward", "model", "in", True, "0"), _row(1, "forward", "model", "out", False, "0"),
            _row(1, "forward", "block", "in", False, "0"), _row(1, "forward", "block", "out", False, "0"),
            _row(0, "optimizer", "block", "param", False, "up"), _row(0, "optimizer", "head", "param", True)]
    return SimpleNamespace(rows=rows + list(extra), oracle_notes_own={})


def test_the_roots_parameters_are_its_whole_subtree():
    """At df55e0a params_equal(dd, "model", 1) was True here: block.up differs after step 0's update."""
    from tpdiag.diff.equal_inputs import params_equal

    dd = _dd()
    assert not params_equal(dd, "model", 1) and not params_equal(dd, "block", 1)
    assert params_equal(dd, "head", 1) and params_equal(dd, "model", 0)
    from tpdiag.diff.equal_inputs import side_params

    assert not side_params(dd, "model", 1)  # not re-executed from this side's parameters
    dd.oracle_notes_own = {"s1/forward/model/oracle#0": {"params": "this side's"}}
    assert side_params(dd, "model", 1) and not side_params(dd, "block", 1)
    # a buffer of its subtree that differs too: parameters alone were swapped in
    dd2 = _dd(_row(0, "optimizer", "block.norm", "buffer", False, "running_mean"))
    dd2.oracle_notes_own = dd.oracle_notes_own
    assert not side_params(dd2, "model", 1)


def test_a_module_is_re_executed_from_the_shipped_parameters_all_or_none():
    from tpdiag.probes.float64 import module_oracle, module_oracle_grads, snapshot
    from tpdiag.probes.own_params import shipped_for, swapped
    from tpdiag.records.side_params import source_key

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    theirs = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    shipped = {source_key(3, o, s): p.detach().clone()
               for n, p in theirs.named_parameters() for o, _, s in [n.rpartition(".")]}
    x = torch.randn(3, 4)
    params = shipped_for(m, "", 3, shipped)
    assert params is not None and len(params) == 4
    with swapped(params):
        out, notes = module_oracle(m, *snapshot(((x,), {})))
        grads, _ = module_oracle_grads(m[0], *snapshot(((x,), {})), torch.ones(3, 4))
    want = theirs.double()(x.double())
    assert notes == {} and torch.equal(out, want)
    # the weight grad's leaf is this side's weight: its input grad is g @ W (theirs)
    assert torch.equal(grads["in0"], torch.ones(3, 4, dtype=torch.float64) @ theirs[0].weight.double())
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())  # restored bitwise
    # the subtree of a child: its path names the records
    assert shipped_for(m[1], "1", 3, shipped) is not None
    # one missing, or another step: nothing swapped (a partial swap is neither side's function)
    assert shipped_for(m, "", 3, {k: v for k, v in shipped.items() if not k.endswith("/bias")}) is None
    assert shipped_for(m, "", 2, shipped) is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("gate_f", "gate_ok"):
        d = tmp_path_factory.mktemp(case) / "r"
        # --no-anchor: step 1 from each side's own update, whose parameters the own-input pass ships
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--dtype", "bfloat16", "--steps", "2",
                    "--no-anchor", "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, d)
    return out


def test_a_grad_judged_by_the_root_at_step_1_is_judged_from_this_sides_parameters(runs):
    """gate_f: the block's step-1 output grad, judged by the root's float64 backward run from this
    side's step-0 update, is a BUG of its own (at df55e0a it 'followed' the gate's grad, judged from
    the reference's weights, and the root's s1 output was a finding of the reference's weights)."""
    from tpdiag.records.causes import cause_class

    s, stdout, d = runs["gate_f"]
    e = s["degrees"]["2"]
    f = next(f for f in e["findings"] if f.get("key") == "s1/backward/block/grad_out#0/0")
    assert cause_class(f["cause"]) == "bug" and "follows" not in f and f.get("enclosing") == "model", f
    assert f["oracle"]["far"], f["oracle"]
    assert not any(g["key"] == "s1/forward/model/out#0/0" for g in e["findings"]), e["findings"]
    assert not e.get("not_judged"), e.get("not_judged")
    ref = next(p for p in d.rglob("tp1/world.json") if "oracle_notes_own" in json.loads(p.read_text()))
    notes = json.loads(ref.read_text())["oracle_notes_own"]["2"]
    assert notes["s1/forward/model/oracle#0"] == {"params": "this side's"}, notes
    assert "s0/forward/model/oracle#0" not in notes  # step 0: the parameters are equal, nothing shipped


def test_the_correct_twin_reads_rounding_with_every_step_1_grad_judged(runs):
    """gate_ok: at df55e0a gate.proj's step-1 output grad was not judged ('whose parameters differ at
    this step'); from this side's parameters it is judged within rounding."""
    s, stdout, d = runs["gate_ok"]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), \
        (e.get("not_judged"), e.get("findings"))
    assert "nothing is wrong" in stdout


def test_the_shipped_parameters_are_the_differing_steps_whole_subtrees_within_the_budget(runs):
    """diff/own_params.side_params on gate_f's records: step 1's forward read step 0's update (it
    differs at TP=2), step 0's the init (equal: nothing shipped); the root's subtree is every
    parameter, gate's only its own; past the budget nothing (never a part of a subtree)."""
    from tpdiag.diff.own_params import side_params

    _, _, d = runs["gate_f"]
    ref, mine = str(d / "tp1"), str(d / "tp2")
    got = side_params(ref, mine, {"model"})
    assert got and all(k.startswith("s0/optimizer/") and "/param#0/" in k for k in got), sorted(got)
    assert {k.split("/")[2] for k in got} == {"embed", "block", "gate.proj", "norm", "head"}, sorted(got)
    assert {k.split("/")[2] for k in side_params(ref, mine, {"gate"})} == {"gate.proj"}
    assert side_params(ref, mine, {"model"}, budget=1000) == {}
