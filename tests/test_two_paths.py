"""An activation grad that leaves its module by code outside any module is judged by the float64
backward of an enclosing module (helpers hbug15, hbf16; tests/models/planted/two_paths.py,
diff/enclosing.py).

`h = h * sigmoid(gate(h))` in the model's forward: h is read by the `gate` module and by the plain
multiply, so the block whose output makes h has no module consumer whose float64 backward is the
exact value of its output grad. gate_f puts Megatron's f in front of the replicated gate (its input
grad all-reduced: TP times at TP=2) - past the first divergence (the block's row-parallel
all-reduce, rounding) the block's output grad moves by a quarter. The root's float64 backward, from
this side's logits grad, taps the block's output: BUG, gate 4.

pair_f hides the same mistake in a stage that returns two tensors (no float64 backward of the stage
is formed). At 0bc1be0 its block's grad was only listed as not judged: in float32 the gate failed it
as cause unknown (exit 1), in bfloat16 compare read "rounding only ... nothing is wrong" and
`gate --allow rounding` passed it (exit 0). The next ancestor that runs once and returns one tensor -
the root - judges it now: BUG, gate 4, in both; the correct twin pair_ok reads rounding.

pair_drop_f: the root's float64 re-execution refused as well (dropout on the embeddings draws random
numbers), so the grad stays not judged, with each grad's own reason; moved by a quarter, it fails the
gate as cause unknown in bfloat16 too (at 0bc1be0 1000 bf16 roundings, 7.8 of the grad's norm, let it
pass: rounding, gate 0), and compare, summary.json and the report say so alike.
"""
import json

import pytest

from conftest import planted_shared, run_cli

SPEC = "py:tests/models/planted/two_paths.py:"
BLOCK_GRAD = "s0/backward/block/grad_out#0/0"
STAGE_BLOCK_GRAD = "s0/backward/stage.block/grad_out#0/0"
CASES = [("gate_f", "bfloat16"), ("pair_f", "float32"), ("pair_f", "bfloat16"), ("pair_ok", "bfloat16"),
         ("pair_drop_f", "bfloat16")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, dtype in CASES:
        if (case, dtype) == ("pair_f", "float32"):  # the same compare as test_failclosed_bounds' (a reader: no report)
            d, stdout = planted_shared(tmp_path_factory, "two_paths", "pair_f", "--tp", "1,2", "--dtype", "float32")
            out[(case, dtype)] = (json.loads((d / "summary.json").read_text()), stdout, d)
            continue
        d = tmp_path_factory.mktemp(f"{case}-{dtype}") / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--dtype", dtype, "--no-baseline",
                    "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[(case, dtype)] = (json.loads((d / "summary.json").read_text()), p.stdout, d)
    return out


@pytest.mark.parametrize("case,dtype,key,where", [
    ("gate_f", "bfloat16", BLOCK_GRAD, "block"),
    ("pair_f", "float32", STAGE_BLOCK_GRAD, "stage.block"),
    ("pair_f", "bfloat16", STAGE_BLOCK_GRAD, "stage.block")])
def test_a_grad_read_by_plain_code_is_judged_by_an_enclosing_module(runs, case, dtype, key, where):
    """gate_f: the nearest enclosing module (the root) judges it. pair_f: the nearest (stage) returns
    two tensors, so the next one up that runs once and returns one tensor (the root) does."""
    from tpdiag.records.causes import cause_class

    s, stdout, d = runs[(case, dtype)]
    e = s["degrees"]["2"]
    assert s["class"] == "bug" and e["class"] == "bug", (s["class"], stdout[-2000:])
    f = next(f for f in e["findings"] if f.get("key") == key)
    assert cause_class(f["cause"]) == "bug" and "follows" not in f and f.get("enclosing") == "model", f
    assert f["oracle"]["far"] and "enclosing module's (model)" in f["oracle"]["what"], f["oracle"]
    assert not e.get("not_judged"), e.get("not_judged")
    assert f"BUG at backward: {where} (grad_out 0): the enclosing module's (model) backward" in stdout, stdout[-3000:]
    p = run_cli("gate", str(d), "--allow", "rounding")
    assert p.returncode == 4, (p.stdout[-2000:], p.stderr[-2000:])
    assert f"module {where}, phase backward, record grad_out 0" in p.stdout, p.stdout


def test_the_correct_twin_reads_rounding_in_bf16(runs):
    """pair_f without the mistake: the root's float64 backward from each side's logits grad leaves
    the stage's block's and gate's output grads within bf16 rounding - judged, nothing left
    unjudged, and the gate passes `--allow rounding`."""
    s, stdout, d = runs[("pair_ok", "bfloat16")]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), (e.get("not_judged"), e.get("findings"))
    assert "nothing is wrong" in stdout
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_what_stays_not_judged_is_said_alike_everywhere_with_each_grads_reason(runs):
    """pair_drop_f: the stage returns two tensors and the root's float64 re-execution is refused
    (dropout draws random numbers): h's grad has no exact value. Each listed grad carries its own
    reason (summary.json not_judged.reasons, the compare line, the report). Moved by a quarter in
    bfloat16, beyond NOT_JUDGED_MAX_REL: the run is not judged in compare's verdict and summary.json's
    class, the report does not call it harmless, and the gate fails it as cause unknown (at 0bc1be0:
    "rounding only ... nothing is wrong", gate 0)."""
    s, stdout, d = runs[("pair_drop_f", "bfloat16")]
    e = s["degrees"]["2"]
    nj = e.get("not_judged") or {}
    assert STAGE_BLOCK_GRAD in nj.get("keys", []), nj
    why = nj["reasons"][STAGE_BLOCK_GRAD]
    assert "judged through model, whose float64 backward was refused: it draws random numbers" in why, why
    # the own-input pass's own refusal (from this side's inputs), and where inside the root it came from
    # (at df55e0a only the reference's note was read: its refusals in that pass were dropped)
    assert "(model's backward re-executed from this side's own inputs, in the own-input pass; refused " \
        "inside it by drop)" in why, why
    assert set(nj["reasons"]) == set(nj["keys"]) and sum(nj["why"].values()) == nj["records"], nj
    assert 0.2 < nj["rel_l2"] < 1 and nj["dtype"] == "bfloat16", nj
    assert s["class"] == e["class"] == "unknown", (s["class"], e["class"])
    assert "verdict: divergent, not judged" in stdout and "nothing is wrong" not in stdout, stdout[-3000:]
    assert f"{STAGE_BLOCK_GRAD} ({why})" in stdout, stdout[-3000:]
    assert run_cli("report", str(d)).returncode == 0
    import html as h

    page = h.unescape((d / "report.html").read_text())
    assert "Not judged: activation grads past the first divergence moved beyond rounding" in page
    assert "Not judged past the first divergence" in page and f"{STAGE_BLOCK_GRAD} ({why})" in page
    p = run_cli("gate", str(d), "--allow", "rounding")
    assert p.returncode == 1, (p.stdout[-2000:], p.stderr[-2000:])
    assert "not judged (summary.json not_judged)" in p.stdout and "cause unknown" in p.stdout, p.stdout


@pytest.mark.parametrize("dtype,moved,fails", [("float32", 0.0987, True), ("bfloat16", 0.0987, False),
                                               ("bfloat16", 0.251, True), ("float16", 0.251, True)])
def test_compare_class_and_gate_read_one_limit(dtype, moved, fails):
    """Whatever stays not judged: summary.json's class (compare's verdict and the report read it) and
    the gate apply one rule (diff/moved_limit.moved_beyond): 0.0987 is how far rounding moved the built-in
    tiny-llama's unjudged grads in bfloat16 (TP=4, two steps: a correct run); in float32 it is ~1e5
    roundings. 0.251: how far pair_f's doubled gate share moved its block's grad, which 1000 bf16 (7.8)
    or float16 (0.98) roundings passed at 0bc1be0 - past NOT_JUDGED_MAX_REL (0.2) in any dtype now. Not
    judged where the gate fails, rounding where it passes."""
    from tpdiag.diff.classes import degree_class
    from tpdiag.gate.policy import Policy
    from tpdiag.gate.result import DegreeResult
    from tpdiag.gate.degree import _moved_unjudged

    entry = {"status": "divergent", "findings": [],
             "first_divergence": {"key": "s0/forward/block/out#0/0", "cause": "row-parallel-reduction"},
             "not_judged": {"records": 1, "keys": [BLOCK_GRAD], "rel_l2": moved, "dtype": dtype}}
    res = DegreeResult("2", "pass")
    _moved_unjudged("2", entry, [{"key": BLOCK_GRAD, "dtype": dtype}], Policy(), res)
    assert bool(res.violations) is fails and all(v.cause == "unknown" for v in res.violations)
    assert degree_class(entry) == ("unknown" if fails else "rounding")


def test_the_judging_ancestor_is_the_nearest_that_runs_once_with_one_output():
    """diff/enclosing.judge: past an ancestor that returns two floating tensors or runs twice, the
    next one up judges, to the root - recorded as "(root)" above a child named "model" (HF's
    LlamaForCausalLM.model), which judges its own children's grads (hname18: both were "model", two
    calls under one name, and nothing judged the embeddings' output grad)."""
    from tpdiag.diff.enclosing import judge, outputs_index

    def out(m, call=0, n=1, dtype="float32"):
        return [{"step": 0, "module": m, "call": call, "phase": "forward", "kind": "out", "dtype": dtype}] * n

    def judged(rows, module="stage.block"):
        mods = {r["module"] for r in rows}
        outs = outputs_index(rows)
        calls = {}
        for r in rows:
            calls.setdefault(r["module"], set()).add(r["call"])
        return judge(module, 0, mods, lambda a: calls.get(a, set()), lambda a: outs.get((0, a), 0))

    base = out("model") + out("stage.block")
    assert judged(base + out("stage")) == "stage"
    assert judged(base + out("stage", n=2)) == "model"  # pair_f
    assert judged(base + out("stage") + out("stage", call=1)) == "model"  # a stage run twice
    assert judged(base + out("stage", n=2) + out("stage", n=1, dtype="int64")) == "model"
    assert judged(base + out("stage", n=1) + out("stage", n=1, dtype="int64")) == "stage"  # ids are no output grad
    hf = out("(root)") + out("model") + out("model.embed_tokens")
    assert judged(hf, "model.embed_tokens") == "model"
    assert judged(hf, "model") == "(root)"
    assert judged(hf + out("model", n=2), "model.embed_tokens") == "(root)"


def test_two_ancestors_taps_of_one_descendant_are_kept_apart():
    """A stage's float64 backward and the root's may both tap the stage's block (the own-input pass
    re-executes each where it judges some record): the tap record names its tapper by how many name
    levels up it is (`.uK`), and the diff reads that back - the same grad_out.O.cJ.pP from the two
    would have been one record listed twice."""
    from tpdiag.probes.oracle_hooks import tap_name

    assert tap_name("tap:stage.block:0:0", 0, "stage") == ("stage.block", "grad_out.0.c0.p0.u1")
    assert tap_name("tap:stage.block:0:0", 0, "model") == ("stage.block", "grad_out.0.c0.p0.u2")
    assert tap_name("tap:layers.0:1:0", 0, "model") == ("layers.0", "grad_out.0.c1.p0.u2")
    # HF's LlamaForCausalLM.model child, recorded as "model": its children are one level below it;
    # the root above it, "(root)", is as many levels above them as their names have parts
    assert tap_name("tap:model.layers.0:0:0", 0, "model") == ("model.layers.0", "grad_out.0.c0.p0.u2")
    assert tap_name("tap:model.layers.0:0:0", 0, "(root)") == ("model.layers.0", "grad_out.0.c0.p0.u3")


def test_the_taps_are_the_childs_output_grad_in_the_parents_float64_backward():
    """module_oracle_grads' taps: the grad at a child's output inside its parent's float64 backward,
    with the child's output also read by the parent's own code, is what float64 autograd gives it -
    also for a parent with no weights of its own and integer inputs (the root: its children's
    weights are constants there, so the tapped output is made a leaf of the graph)."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import module_oracle_grads, snapshot

    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 5)
            self.a = nn.Linear(5, 5)
            self.g = nn.Linear(5, 5)

        def forward(self, ids):
            h = self.a(self.emb(ids))
            return h * torch.sigmoid(self.g(h))

    torch.manual_seed(0)
    m = P()
    ids = torch.tensor([[1, 3, 5, 6]])
    gout = torch.randn(1, 4, 5)
    taps = {m.a: "a", m.g: "g"}
    grads, notes = module_oracle_grads(m, *snapshot(((ids,), {})), gout, taps=taps)
    assert not notes and set(grads) == {"tap:a:0:0", "tap:g:0:0"}, (grads.keys(), notes)
    m64 = P().double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    h = m64.a(m64.emb(ids)).detach().requires_grad_(True)
    gh = m64.g(h)
    y = h * torch.sigmoid(gh)
    want_h, want_g = torch.autograd.grad(y, [h, gh], gout.double(), retain_graph=True)
    assert grads["tap:a:0:0"].dtype == torch.float64
    assert torch.equal(grads["tap:a:0:0"], want_h) and torch.equal(grads["tap:g:0:0"], want_g)
    # the plain multiply's share is in it: the gate's input grad alone is not
    assert not torch.allclose(want_h, torch.autograd.grad(gh, h, want_g)[0])


def test_an_output_changed_in_place_by_its_parent_is_not_tapped():
    """`h = self.a(x); h += x` in the parent: the recorded grad of a's output is the grad before the
    in-place add (its hook saw that value); autograd asked for the grad of h after it gives another
    tensor's. Such a tap is left out (not judged), never a wrong exact value; the parent's own grads
    stay."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import module_oracle_grads, snapshot

    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)

        def forward(self, x):
            h = self.a(x)
            h += x
            return self.b(h) * h

    torch.manual_seed(0)
    m = P()
    x = torch.randn(3, 5)
    grads, notes = module_oracle_grads(m, *snapshot(((x,), {})), torch.randn(3, 5), taps={m.a: "a", m.b: "b"})
    assert not notes and "tap:a:0:0" not in grads and {"tap:b:0:0", "in0"} <= set(grads), (set(grads), notes)
