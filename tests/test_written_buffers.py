"""State a training forward writes into a BUFFER (tests/models/planted/balance_bias.py: DeepSeek-V3's
auxiliary-loss-free load-balancing bias, nudged after use from each rank's own experts' load, the
load's all-reduce forgotten). Step 0 is right; the replicated bias differs between the ranks after
it, and step 1 routes by it.

On 2d251fd no record held a buffer: the first divergence was step 1's `moe` output, every input it
read bitwise equal, cause `unknown` (its float64 re-execution refused: it writes state), and the BUG
was named downstream at step 1's `moe.router` output grad. Now every floating buffer the step wrote
is recorded after the step (kind "buffer", read by the next step's forward as a parameter is): the
bias itself is the BUG, rank-inconsistent, at step 0. The twin (the load all-reduced) is bitwise.
"""
import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("case", ["local_load", "global_load"])
def test_a_buffer_the_forward_writes_per_rank_is_the_bug(case, tmp_path):
    from tpdiag.diff.classes import leading_bug

    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/balance_bias.py:{case}", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    e = s["degrees"]["2"]
    gate = run_cli("gate", str(d)).returncode
    if case == "global_load":
        assert e["status"] == "bitwise", e.get("first_divergence")
        assert gate == 0
        return
    fd = e["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe/buffer#0/bias", "rank-inconsistent-replica"), fd
    lead = leading_bug(e)
    assert lead is not None and lead["key"] == fd["key"], lead
    assert "optimizer: moe (buffer bias, written during the step)" in p.stdout, p.stdout[-2000:]
    assert "unknown" not in p.stdout, p.stdout[-2000:]
    assert gate == 4


def test_a_module_that_writes_its_own_buffer_is_still_judged_in_float64(tmp_path):
    """tests/models/planted/amax_history.py:amax_max, correct: an FP8-style fake-quantised column-parallel
    layer whose forward writes its amax history (a buffer, all-reduced with MAX: bitwise TP=1's). The
    first divergence is the row-parallel all-reduce of the MLP holding it. On 2d251fd that module's
    float64 re-execution was refused ('it writes state in place'): cause unknown, verdict 'not judged'.
    The re-execution now starts each buffer the real forward wrote from a float64 copy of its value
    before that forward (probes/float64.buffers_before), which it may write: rounding, named."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/amax_history.py:amax_max", "--tp", "1,2",
                "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    fd = e["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/forward/mlp/out#0/0", "row-parallel-reduction"), fd
    assert "writes state" not in p.stdout and "unknown" not in p.stdout, p.stdout[-2000:]
    assert e["class"] == "rounding" and not e.get("findings"), e.get("findings")


def test_the_float64_reexecution_starts_a_written_buffer_from_its_value_before_the_forward():
    import torch
    from torch import nn

    from tpdiag.probes.float64 import buffers_before, module_oracle, snapshot

    class Ema(nn.Module):  # scales by the running value it read, then updates it
        def __init__(self):
            super().__init__()
            self.register_buffer("run", torch.full((3,), 2.0))

        def forward(self, x):
            y = x * self.run
            self.run.mul_(0.5).add_(0.5 * x.abs())
            return y

    m, x = Ema(), torch.randn(3)
    snap, bufs = snapshot(((x,), {})), buffers_before(m)
    y = m(x)
    after = m.run.clone()
    out, notes = module_oracle(m, *snap, buffers=bufs)
    assert out is not None, notes
    assert out.dtype == torch.float64 and torch.equal(out, x.double() * 2.0)   # read the value before
    assert torch.equal(m.run, after) and torch.equal(y, x * 2.0)               # the real buffer untouched
    out, notes = module_oracle(m, *snap)  # no snapshot of the buffers: refused as before
    assert out is None and "writes state" in notes["why"]


def test_a_buffer_written_wrong_on_every_rank_alike_is_judged_against_its_float64_value(tmp_path):
    """amax_history.py:amax_sum: the amax all-reduced with SUM, so every rank holds the same wrong
    amax (no rank inconsistency to see) and step 1 quantises with another scale. On 2d251fd it read
    'not judged (cause unknown)' (the MLP's float64 re-execution refused: it writes state); with that
    re-execution allowed and the buffer recorded, 'rounding only' (no record judged the buffer; step
    1's differences passed as the spread of step 0's rounding), gate exit 1. Now the layer, whose step-0 forward read only equal inputs, is re-executed
    in float64 in the second pass, which keeps the value it writes into the buffer: the buffer record
    is the BUG, far beyond rounding; the first divergence stays the MLP's all-reduce (rounding)."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/amax_history.py:amax_sum", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    from tpdiag.diff.classes import leading_bug

    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    lead = leading_bug(e)
    assert lead is not None and (lead["key"], lead["cause"]) == ("s0/optimizer/mlp.up/buffer#0/amax",
                                                                 "sharding-bug"), lead
    assert lead["oracle"]["far"] and lead["bound_ratio"] > 1e3, lead
    assert "BUG" in p.stdout.splitlines()[0] and "optimizer: mlp.up (buffer amax" in p.stdout, p.stdout[-2000:]
    assert run_cli("gate", str(d)).returncode == 4


def test_nested_oracle_modules_share_one_copy_of_a_buffer_until_it_is_written(monkeypatch):
    """A buffer under several re-executed modules (the model, its block, the block's layer) is
    copied once per value, not once per module: on 2f72fdf each pre-forward hook cloned every buffer
    of its subtree anew and the copies lived to the backward (the oracle's backward hook holds
    them) - a KV cache at real size held depth times over. The copy is still the value each call
    read: a buffer written between two calls is copied again, and the float64 re-execution of the
    module that wrote it starts from the value before (as it did)."""
    import torch
    from torch import nn

    from tpdiag.probes import float64
    from tpdiag.probes.module_probe import module_probes
    from tpdiag.probes.recorder import Recorder

    class Layer(nn.Module):  # reads a large table, and writes a running value after use
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(64, 4))
            self.register_buffer("run", torch.ones(4))

        def forward(self, x):
            y = self.lin(x * self.run) + self.table[:x.shape[0]]
            with torch.no_grad():
                self.run.mul_(0.5).add_(0.5 * x.abs().mean(0))
            return y

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Layer()

        def forward(self, x):
            return self.layer(x).relu()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x) + self.block(x)  # two calls: the second reads the written `run`

    lists = []
    real = float64.buffers_before
    monkeypatch.setattr(float64, "buffers_before", lambda *a, **k: lists.append(real(*a, **k)) or lists[-1])
    m, x = Model(), torch.randn(3, 4)
    run0 = m.block.layer.run.clone()
    with module_probes(m, Recorder(mode="full"), oracle={"model", "block", "block.layer"}):
        m(x).sum().backward()
    assert len(lists) == 5  # model; block and its layer, twice
    copies = {(id(b), k): [] for b in [m.block.layer] for k in ("table", "run")}
    for got in lists:
        for owner, k, b, version, copy in got:
            copies[(id(owner), k)].append(copy)
    tables, runs = copies[(id(m.block.layer), "table")], copies[(id(m.block.layer), "run")]
    assert all(t is tables[0] for t in tables), "an unchanged buffer is copied once"
    assert all(r is runs[0] for r in runs[:3]) and runs[3] is runs[4] and runs[3] is not runs[0]
    assert torch.equal(runs[0], run0) and not torch.equal(runs[3], run0)  # the value each call read


@pytest.mark.parametrize("case", ["local_load", "global_load"])
def test_a_buffer_written_on_one_rank_only_is_recorded_on_every_rank(case, tmp_path):
    """tests/models/planted/balance_tol.py: the load-balancing bias nudged only where the loads'
    spread passes a tolerance, each rank deciding from its own experts' load (local_load): at TP=2
    one rank writes the bias and the other does not. On 2f72fdf only the writing rank recorded it:
    the ranks' record streams differed and the run read 'inconclusive: ... the model is not SPMD'
    (exit 2), the wrong replica unnamed (2d251fd, recording no buffer, named it downstream at step
    1). Every rank now records a buffer any rank wrote: the bias is the rank-inconsistent replica, at
    step 0. The twin (the loads all-reduced first) stays bitwise."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/balance_tol.py:{case}", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    if case == "global_load":
        assert e["status"] == "bitwise", e.get("first_divergence")
        return
    fd = e["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe/buffer#0/bias", "rank-inconsistent-replica"), fd
    assert "BUG" in p.stdout.splitlines()[0] and "inconclusive" not in p.stdout, p.stdout[-2000:]


def test_the_verdict_line_of_a_buffer_names_the_forward_that_wrote_it():
    """A buffer's float64 value is what its writer's forward left in it (diff/oracle.apply's
    bound_model says so); the headline's line said 'the module re-executed in float64', as for an
    output (2f72fdf)."""
    from tpdiag.cli.render import oracle_line

    v = {"far": True, "ratio": 1.3e5, "err": 0.99, "ref_err": 2.5e-8, "threshold": 7.6e-6, "relative": True}
    fd = {"phase": "optimizer", "module": "mlp.up", "kind": "buffer", "name": "amax", "cause": "sharding-bug",
          "oracle": v}
    line = oracle_line(fd)
    assert "the forward that wrote it re-executed in float64" in line and "BUG" in line, line


def test_a_shared_buffer_copy_is_not_reused_after_a_write_the_version_counter_missed():
    """A write through `.data` moves no version counter: an enclosing module that writes its child's
    buffer that way before calling it leaves the child reading other bits than the copy made at the
    enclosing call - that copy, reused, would start the child's float64 re-execution from a value it
    never read. The bits are compared before a copy is shared."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import buffers_before

    child = nn.BatchNorm1d(3)
    parent = nn.Sequential(child)
    shared = {}
    first = buffers_before(parent, shared)
    again = buffers_before(child, shared)
    assert all(a[4] is b[4] for a, b in zip(first, again))  # unchanged: one copy
    child.running_mean.data.add_(1.0)                       # no version counter moves
    later = {k: c for _, k, _, _, c in buffers_before(child, shared)}
    assert torch.equal(later["running_mean"], child.running_mean)
    assert later["running_var"] is {k: c for _, k, _, _, c in first}["running_var"]
