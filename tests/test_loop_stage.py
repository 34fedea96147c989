"""A stage applied twice per step (a looped / weight-shared block), its MLP hand-sharded Megatron
style: each rank multiplies by its slice of the whole weights (tests/models/planted/loop_stage.py).
At TP=1 the full slice `up[0:FF]` dispatches an `aten::slice`, `down[:, 0:FF]` none; at TP=2 both
do. The op probe counted a module's ops across its calls, so the reference's first call had one
slice, TP=2's two, and the second call's up-slice (TP=1's aten::slice#1) was paired with TP=2's
first call's down-slice - gathered to the same shape, 1.24 apart: on 0bc1be0 loop_ok read a false
`BUG at stage.block (op aten::slice#1.0)` (sharding-bug, 2.6e6x), and loop_bias's real mistake was
named at that slice. Ops are keyed by their module's call now (op#C), counted within it."""
import csv
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/loop_stage.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("loop_ok", "loop_bias"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, d)
    return out


def test_the_correct_looped_block_reads_rounding_with_its_real_cause(runs):
    from tpdiag.records.causes import cause_class

    s, stdout, d = runs["loop_ok"]
    e = s["degrees"]["2"]
    fd = e["first_divergence"]
    assert s["class"] == e["class"] == "rounding", (s["class"], stdout[-3000:])
    assert fd["module"] == "stage.block" and fd["cause"] == "row-parallel-reduction", fd
    assert fd["op"] == "c10d::allreduce_" and not fd["oracle"]["far"], fd
    assert not [f for f in e.get("findings") or () if cause_class(f.get("cause")) == "bug"], e["findings"]
    assert "BUG" not in stdout and "nothing is wrong" in stdout, stdout[-3000:]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_each_calls_ops_pair_with_the_same_calls_ops_of_the_reference(runs):
    """The second call's weight slice is compared with the reference's second call's (bitwise: the
    rank's rows gathered are the whole weight), and the down-slice only TP=2 runs is left out as
    only at this degree, in both calls."""
    _, _, d = runs["loop_ok"]
    rows = {r["key"]: r for r in csv.DictReader(open(d / "ops" / "diff.csv")) if r["degree"] == "2"}
    for call in (0, 1):
        r = rows[f"s0/forward/stage.block/op#{call}/aten::slice#0.0"]
        assert r["bitwise"] == "True" and r["layout"] == "shard:0", r
        assert f"s0/forward/stage.block/op#{call}/aten::slice#1.0" not in rows
    s = json.loads((d / "ops" / "summary.json").read_text())
    assert s["degrees"]["2"]["not_compared"]["why"].get("no reference op of the same shape") is None, s["degrees"]["2"]


def test_a_mistake_in_the_looped_block_reads_bug_at_the_block(runs):
    """The bias added on every rank before g's all-reduce: BUG at the block, named where the
    difference enters (the all-reduce of the ranks' partials), not at a weight slice."""
    from tpdiag.records.causes import cause_class

    s, stdout, d = runs["loop_bias"]
    e = s["degrees"]["2"]
    fd = e["first_divergence"]
    assert s["class"] == e["class"] == "bug", (s["class"], stdout[-3000:])
    assert fd["module"] == "stage.block" and cause_class(fd["cause"]) == "bug" and fd["oracle"]["far"], fd
    assert fd["op"] == "c10d::allreduce_", fd
    assert "aten::slice" not in stdout, stdout[-3000:]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4


def test_ops_are_keyed_by_their_modules_call_in_process():
    """At TP=1, in process: the stage's two calls have their ops under op#0 and op#1, each counted
    from 0 (on 0bc1be0 all under op#0, the second call's mm#2 and mm#3). A root with a child named
    `model` (HF's LlamaForCausalLM.model) records as "(root)" and keeps its own ops after the child
    returns under its own name and call, not the child's (both were `model` before RECORD_FORMAT 3)."""
    import importlib.util
    import pathlib

    import torch
    from torch import nn

    from tpdiag.probes.module_probe import module_probes
    from tpdiag.probes.op_probe import OpProbe
    from tpdiag.probes.recorder import Recorder

    path = pathlib.Path(__file__).parent / "models" / "planted" / "loop_stage.py"
    spec = importlib.util.spec_from_file_location("tpdiag_planted_loop_stage", path)
    planted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planted)

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = planted.LoopLM()  # recorded as `model` (its children model.*), the root "(root)"

        def forward(self, t):
            return self.model(t) * 2.0  # the root's own op, after its child's call

    torch.manual_seed(0)
    root = Root()
    rec = Recorder(mode="full")
    rec.phase = "forward"
    with torch.no_grad(), module_probes(root, rec, backward=False), OpProbe(rec):
        root(torch.randint(0, planted.VOCAB, (planted.BATCH, planted.SEQ)))
    keys = [m["key"] for m, _ in rec.records if m["kind"] == "op"]
    mms = [k for k in keys if "/model.stage.block/" in k and "aten::mm#" in k]
    assert mms == [f"s0/forward/model.stage.block/op#{c}/aten::mm#{n}.0" for c in (0, 1) for n in (0, 1)], mms
    assert "s0/forward/(root)/op#0/aten::mul#0.0" in keys, [k for k in keys if "/model/" in k or "(root)" in k]
    assert not [k for k in keys if k.startswith("s0/forward/model/op#") and "aten::mul" in k], keys
