"""State a training step writes (helper hleft11; tests/test_written_buffers.py has the first cases):
which float64 re-execution judges a written buffer (its owner's, not an ancestor's), buffers written
where the version counter cannot see, micro-batches that read what the one before wrote, per-rank
statistics nobody reads, and a reader of a buffer written wrong earlier in the same step."""
import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("case", ["amax_sum", "amax_max"])
def test_a_written_buffer_is_judged_against_its_owners_float64_run_not_an_ancestors(case, tmp_path):
    """tests/models/planted/amax_fp8_input.py: the MLP casts its input to FP8 (e5m2) before its `up`
    layer, whose amax buffer is all-reduced with SUM (amax_sum: about twice TP=1's, every rank alike).
    The MLP (the first divergence) and `up` are both re-executed in float64; the MLP's run, recorded
    last, computes up's input without the FP8 rounding (float64 has no FP8 cast), so its amax is a
    few percent from what `up` really read. On 0428e29 that last value judged the buffer while its
    equal-inputs check read `up`'s: the reference 1e-2 from it, the SUM's 2x inside 128 x that, and
    the run read 'rounding only'. The owner's own re-execution now judges it: BUG, far beyond."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/amax_fp8_input.py:{case}", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    from tpdiag.diff.classes import leading_bug

    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    if case == "amax_max":
        assert e["class"] == "rounding" and leading_bug(e) is None, e.get("findings")
        return
    lead = leading_bug(e)
    assert lead is not None and (lead["key"], lead["cause"]) == ("s0/optimizer/mlp.up/buffer#0/amax",
                                                                 "sharding-bug"), lead
    assert lead["oracle"]["ref_err"] < 1e-6 and lead["bound_ratio"] > 1e3, lead


@pytest.mark.parametrize("case", ["local", "synced"])
def test_a_buffer_written_where_the_version_counter_cannot_see_is_recorded(case, tmp_path):
    """tests/models/planted/amax_data.py: the amax written through `.data` and, where the ranks sync
    it, by an in-place all-reduce on the buffer - neither moves the version counter. On 0428e29 no
    buffer record was made: local (the all-reduce forgotten, each rank its own amax) read 'rounding
    only', gate exit 1. The step's start now keeps a copy of each floating buffer's bytes
    (model_walk.buffer_state) and a buffer whose bytes changed is recorded: the replica is the BUG at
    step 0; the twin's amax is recorded and bitwise TP=1's."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/amax_data.py:{case}", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    events = [json.loads(line) for line in (d / "tp2" / "events.jsonl").read_text().splitlines()]
    assert "s0/optimizer/mlp.up/buffer#0/amax" in {m["key"] for m in events}
    if case == "synced":
        assert e["class"] == "rounding" and not e.get("findings"), e.get("findings")
        return
    from tpdiag.diff.classes import leading_bug

    lead = leading_bug(e)
    assert lead is not None and (lead["key"], lead["cause"]) == ("s0/optimizer/mlp.up/buffer#0/amax",
                                                                 "rank-inconsistent-replica"), lead
    assert run_cli("gate", str(d)).returncode == 4


def test_a_micro_batch_that_reads_what_the_one_before_it_wrote_is_named(tmp_path):
    """amax_history.py:amax_max at TP=1, micro-batches of 2 sequences against 1: the second piece's
    forward quantises with the amax the first piece's forward wrote, where the whole batch's call read
    the step's starting value. On 0428e29 the verdict said 'its exact result for a row depends on the
    other rows of its call' - no row of the call is involved. The step now notes the buffers written
    before a later piece (world.json piece_state) and the reason names the buffer and the pieces."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/amax_history.py:amax_max", "--tp", "1",
                "--micro-batch", "2,1", "--steps", "1", "--seq-len", "8", "--no-confirm", "--no-baseline",
                "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    entry = json.loads((d / "summary.json").read_text())["configurations"]["1-mb1"]
    fd = entry["first_divergence"]
    assert fd["module"] == "mlp.up" and fd["cause"] == "sharding-bug", fd
    assert "buffer mlp.up.amax" in fd["why"] and "the micro-batch before it wrote" in fd["why"], fd["why"]
    assert "other rows of its call" not in fd["why"], fd["why"]


def test_the_float64_reexecution_starts_from_the_value_before_a_data_write():
    """A forward that writes its buffer through `.data` (no version counter moves): on 0428e29 its
    float64 re-execution read the buffer as the real forward LEFT it (x * the new running value) and
    wrote the real buffer again through `.data`. The bytes are compared with the copy taken before
    the forward (float64_state._as_before): it starts from the value the forward read."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import buffers_before, module_oracle, snapshot

    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("run", torch.full((3,), 2.0))

        def forward(self, x):
            y = x * self.run
            self.run.data.mul_(0.5).add_(0.5 * x.abs())
            return y

    m, x = Ema(), torch.randn(3)
    snap, bufs = snapshot(((x,), {})), buffers_before(m)
    m(x)
    after = m.run.clone()
    out, notes = module_oracle(m, *snap, buffers=bufs)
    assert out is not None and torch.equal(out, x.double() * 2.0), (out, notes)
    assert torch.equal(m.run, after)  # the real buffer untouched
    assert torch.equal(notes["written"]["run"], 0.5 * 2.0 + 0.5 * x.double().abs())


@pytest.mark.parametrize("case", ["logged", "read"])
def test_a_per_rank_statistic_no_step_reads_is_no_bug(case, tmp_path):
    """tests/models/planted/load_stats.py: `seen` counts each rank's own experts' tokens, so its replicas
    differ by design. logged: nothing reads it - on 0428e29 it read BUG rank-inconsistent-replica, gate
    exit 4, though the model computes TP=1's values bitwise. It now reads `unknown`, saying the buffer
    differs across ranks and no recorded step reads it (step 1's MoE bitwise on every rank). read: the
    bias is nudged from `seen`, so step 1 routes by per-rank state: the BUG stays, saying step 1 reads it."""
    from tpdiag.diff.classes import leading_bug

    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/load_stats.py:{case}", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    fd = e["first_divergence"]
    gate = run_cli("gate", str(d)).returncode
    if case == "logged":
        assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe/buffer#0/seen", "unknown"), fd
        assert "not read by any recorded step" in fd["why"], fd["why"]
        assert leading_bug(e) is None and "BUG" not in p.stdout, p.stdout[-2000:]
        assert gate not in (0, 4), gate
        return
    lead = leading_bug(e)
    assert lead is not None and lead["cause"] == "rank-inconsistent-replica", lead
    assert "step 1 reads it" in lead["why"], lead
    assert gate == 4


def test_a_buffer_written_under_a_child_named_model_maps_to_its_own_record():
    """HF's CausalLM root and its `model` child both record as "model". Their float64 re-executions
    each named a buffer they wrote by its path under themselves: the child's `rotary.inv_freq` mapped
    to a record of a module `rotary` that does not exist (0428e29: two oracle records, one pointing
    nowhere; with the root's refused or not re-executed, the buffer was left unjudged without a word).
    The oracle record now names the buffer by its path in the model, written once by its nearest
    re-executed writer (probes/oracle_hooks.buffer_path, nearer_writer)."""
    import torch
    from torch import nn

    from tpdiag.diff.oracle import target_key
    from tpdiag.probes.module_probe import module_probes
    from tpdiag.probes.recorder import Recorder

    class Rotary(nn.Module):  # a table rebuilt in the forward (dynamic RoPE's inv_freq)
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4))

        def forward(self, x):
            with torch.no_grad():
                self.inv_freq.copy_(1.0 / (1.0 + x.abs().amax(0)))
            return x * self.inv_freq

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = Rotary()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(self.rotary(x))

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.head = nn.Linear(4, 4)

        def forward(self, x):
            return self.head(self.model(x))

    m, x = CausalLM(), torch.randn(3, 4)
    rec = Recorder(mode="full")
    with module_probes(m, rec, oracle={"model"}):
        m(x).sum().backward()
    got = [(meta["key"], target_key(meta["key"])) for meta, _ in rec.records
           if meta["kind"] == "oracle" and "/buffer." in meta["key"]]
    assert [t for _, t in got] == ["s0/optimizer/model.rotary/buffer#0/inv_freq"], got


def test_a_differing_buffer_no_float64_run_judged_says_why():
    """A buffer the step wrote, differing, that no float64 re-execution left a value for (its writer
    refused: it draws random numbers; or not re-executed) was left with no word of why (0428e29):
    the refusal, or the missing re-execution, is now its reason."""
    from types import SimpleNamespace

    from tpdiag.diff import oracle

    def row(module, name, idx):
        return {"key": f"s0/optimizer/{module}/buffer#0/{name}", "step": 0, "phase": "optimizer",
                "module": module, "kind": "buffer", "call": 0, "name": name, "idx": idx, "bitwise": False}

    rows = [row("noisy", "amax", 0), row("plain", "stat", 1)]
    dd = SimpleNamespace(rows=rows, oracle={}, oracle_writer={},
                         oracle_notes={"s0/forward/noisy/oracle#0": {"why": "it draws random numbers (aten::bernoulli)"}})
    oracle.apply(dd)
    assert rows[0]["oracle_refused"] == "it draws random numbers (aten::bernoulli)", rows[0]
    assert "no float64 re-execution" in rows[1]["oracle_refused"], rows[1]


@pytest.mark.parametrize("case", ["amax_sum", "amax_max"])
def test_a_reader_of_a_buffer_written_wrong_earlier_in_the_step_is_not_the_bug(case, tmp_path):
    """tests/models/planted/amax_current.py: FP8 current scaling - `mlp.observer` writes the amax
    (all-reduced with SUM: wrong), and `mlp.quant` beside it reads that buffer in the same forward. No
    input record of `quant` holds the amax it read: on 0428e29 its inputs read bitwise equal and it
    was named the BUG (3e4x beyond rounding), though its code is right. Its inputs are no longer
    taken as known equal (diff/written_state.py): it reads `unknown`, naming the buffer; the bug is
    named where the wrong write is (the MLP holding the observer, and the observer's buffer)."""
    from tpdiag.diff.classes import leading_bug

    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/amax_current.py:{case}", "--tp", "1,2",
                "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    if case == "amax_max":
        assert e["class"] == "rounding" and leading_bug(e) is None, e.get("findings")
        return
    fd = e["first_divergence"]
    assert fd["module"] == "mlp.quant" and fd["cause"] == "unknown", fd
    assert "may read buffer amax of mlp.observer" in fd["why"], fd["why"]
    lead = leading_bug(e)
    assert lead is not None and lead["module"] in ("mlp", "mlp.observer"), lead
    causes = {f["key"]: f["cause"] for f in e["findings"] if "key" in f}
    assert causes.get("s0/optimizer/mlp.observer/buffer#0/amax") == "sharding-bug", causes
    assert causes.get("s0/forward/mlp.quant/out#0/0") != "sharding-bug", causes


def test_a_buffers_choices_are_every_call_of_its_writer():
    """A module called twice in a step writes its buffer at each call; what the step leaves is the
    last call's doing, and a choice either call made may have flipped it. On 0428e29 a buffer read its
    owner's call 0 notes only: a top-k at call 1 went unseen and a far value was called a bug. It now
    reads every call of the module whose float64 run holds its value (diff/engine.oracle_writer), and
    not that module's ops' own notes."""
    from types import SimpleNamespace

    from tpdiag.diff.oracle import notes_for

    key = "s0/optimizer/moe/buffer#0/bias"
    row = {"key": key, "step": 0, "phase": "optimizer", "module": "moe", "kind": "buffer", "call": 0, "name": "bias"}
    dd = SimpleNamespace(oracle_writer={key: (0, "moe")}, oracle_notes={
        "s0/forward/moe/oracle#0": {},
        "s0/forward/moe/oracle#1": {"discrete": ["aten::topk"]},
        "s0/forward/moe/oracle#0/aten::sort": {"why": "an op's own refusal"},
        "s0/forward/other/oracle#0": {"discrete": ["aten::argmax"]}})
    assert notes_for(dd, row) == {"discrete": ["aten::topk"]}


def test_a_later_module_that_reads_no_written_buffer_is_judged(tmp_path):
    """tests/models/planted/amax_then_bug.py:swapped: `observer` keeps a per-rank amax (its MAX
    all-reduce forgotten: the replicas differ) that nothing reads in the step, and `proj` after it -
    a hand-written column-parallel layer and its GELU - gathers the ranks' columns in reversed order.
    On 170f498 every module whose record came after the observer's forward was refused ("it may read
    buffer amax of observer"): proj's forward read `unknown`, the real bug named at its weight grad
    only. The reference's float64 re-execution of proj now notes which other modules' buffers it read
    (none): proj's forward is judged, a sharding-bug; the buffer stays a finding of its own."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/amax_then_bug.py:swapped", "--tp", "1,2",
                "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    causes = {f["key"]: f["cause"] for f in e["findings"] if "key" in f}
    assert causes.get("s0/forward/proj/out#0/0") == "sharding-bug", e["findings"]
    assert causes.get("s0/optimizer/observer/buffer#0/amax") == "rank-inconsistent-replica", causes
    assert e["first_divergence"]["module"] == "proj" and e["first_divergence"]["cause"] == "sharding-bug", \
        e["first_divergence"]


def test_the_float64_reexecution_notes_the_state_a_call_reads_from_outside():
    """What diff/written_state reads: the buffers of other modules a re-executed call read (by their
    path in the model), and a count of other outside tensors (a global, a shared object's tensor);
    its own parameters, buffers, tensor attributes, inputs and constants are no note."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import module_oracle, snapshot, state_names

    kept = torch.full((4,), 2.0)  # a global the user's code reads

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("amax", torch.ones(()))

    class Reader(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache = torch.arange(4.0)
            self.scaling = [scale]  # shared, not a submodule

        def forward(self, x):
            return self.lin(x) * self.scaling[0].amax + self.cache + torch.tensor(3.0)

    class Own(Reader):
        def forward(self, x):
            return self.lin(x) + self.cache + torch.tensor(3.0)

    class Global(Reader):
        def forward(self, x):
            return self.lin(x) * kept

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = Scale()
            self.reader, self.own, self.glob = Reader(self.scale), Own(self.scale), Global(self.scale)

    r, x = Root(), torch.randn(3, 4)
    names = state_names(r)
    got = {n: module_oracle(getattr(r, n), *snapshot(((x,), {})), names=names) for n in ("reader", "own", "glob")}
    assert all(out is not None for out, _ in got.values()), got
    assert got["reader"][1] == {"reads": ["scale.amax"]}, got["reader"][1]
    assert got["own"][1] == {}, got["own"][1]
    assert got["glob"][1] == {"reads_unnamed": 1}, got["glob"][1]


def test_a_tensor_attribute_that_is_another_modules_buffer_is_a_read_of_that_buffer():
    """A module that keeps another module's buffer as a plain attribute (`self.amax = observer.amax`:
    nn.Module stores a tensor that is no parameter or buffer of its own in its __dict__) reads that
    buffer. Reviewer hreview13: on c8df0f6 every tensor attribute of the call's subtree counted as its
    own state, so the read went unnoted - diff/written_state then judged the reader on inputs its
    records do not hold (the buffer, written earlier in the step and differing), where a read is to
    be refused. A tensor attribute of its own stays no note."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import module_oracle, snapshot, state_names

    class Observer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("amax", torch.ones(()))

    class Quant(nn.Module):
        def __init__(self, observer):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.amax = observer.amax  # the observer's buffer itself, held as a plain attribute
            self.offset = torch.arange(4.0)  # a tensor attribute of its own

        def forward(self, x):
            return self.lin(x) / self.amax + self.offset

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.observer = Observer()
            self.quant = Quant(self.observer)

    r, x = Root(), torch.randn(3, 4)
    out, notes = module_oracle(r.quant, *snapshot(((x,), {})), names=state_names(r))
    assert out is not None, notes
    assert notes == {"reads": ["observer.amax"]}, notes
