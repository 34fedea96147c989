"""A shape break after a rounding difference is a BUG where the code that made the record could not let a
value decide its shape (diff/shape_break.settle), and stays `unknown` where it could (helper hshape22).

tests/models/planted/seq_chunks.py is a dense user LM: layer 0 a plan-split MLP (its row-parallel
all-reduce rounds otherwise at TP=2), layer 1 a hand-written sequence-parallel MLP over 5 positions.
`chunks_floor` slices S // TP positions per rank and drops the remainder: the ranks' `block1.mlp` input
holds 4 of the 5 positions. On main that read `unknown` (gate 1) - "a record before it differed already"
- as if rounding could have changed a shape no value decides. Now: the second pass re-executes `block1`
in float64 at the reference, sees no op through which a value decides a shape, and calls it
`sharding-bug` (gate 4); its correct twin (`chunks_ok`, ceil slices, padded) reads rounding (gate 0).
The parallel-residual variant's `block1` reads the embedding bitwise: pass 1 alone names it (inputs-equal).
The correct MoE whose router flip changes an expert's token count (moe_expert_calls.py:calls_ok) stays
`unknown` (tests/test_shape_break_flip.py): its block's `nonzero` lets a value decide the count. So does
its real dispatch bug (`calls_split`, each expert keeps 1/TP of its tokens at TP > 1): the same `nonzero`
in the same block - the records cannot tell that count from a flipped one; the gate fails it (exit 1),
it is not named a bug. Edited summaries that relabel a re-derived bug are refused (exit 2)."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/seq_chunks.py:"
BREAK = "s0/forward/block1.mlp/in#0/0"


def _compare(d, spec):
    p = run_cli("compare", "--model", spec, "--tp", "1,2", "--dtype", "bfloat16", "--no-baseline",
                "--no-confirm", "--forward-only", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return p, json.loads((d / "summary.json").read_text())


def _gate(d, *more):
    return run_cli("gate", str(d), *more).returncode


def _edited(d, files, edit, *gate_args):
    """The gate's exit code with edit(summary) applied to each of `files` (restored after)."""
    before = {f: (d / f).read_text() for f in files}
    try:
        for f in files:
            s = json.loads(before[f])
            edit(s)
            (d / f).write_text(json.dumps(s))
        return _gate(d, *gate_args)
    finally:
        for f, text in before.items():
            (d / f).write_text(text)


def _relabel_unknown(s):
    e = s["degrees"]["2"]
    for f in e["findings"]:
        if f.get("key") == BREAK:
            f["cause"] = "unknown"
    s["class"] = e["class"] = "unknown"


def test_a_dense_shape_bug_behind_rounding_is_a_bug_its_twin_rounding(tmp_path):
    d = tmp_path / "floor"
    p, s = _compare(d, SPEC + "chunks_floor")
    e = s["degrees"]["2"]
    # the break comes after layer 0's rounding
    assert e["shape_break"]["key"] == BREAK, e["shape_break"]
    assert e["shape_break"]["after"] == "s0/forward/mlp0.down/out#0/0", e["shape_break"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    f = next(f for f in e["findings"] if f["key"] == BREAK)
    assert f["cause"] == "sharding-bug" and f["shape_break"] is True and f.get("from") == "second pass", f
    # pass 1 alone could not judge it: the second pass's re-execution of its producer did
    assert e["shape_break"]["producer"] == "block1" and e["shape_break"]["by"] is None, e["shape_break"]
    assert "the 2 ranks hold 256 of its 320 elements" in f["why"], f["why"]
    assert "(block1, re-executed in float64) let no value decide a shape" in f["why"], f["why"]
    # what the second pass's reference noted: it re-executed block1 and no shaped op ran there
    notes = json.loads((d / "ops" / "tp1" / "world.json").read_text())["oracle_notes"]
    assert not (notes.get("s0/forward/block1/oracle#0") or {}).get("shaped"), notes
    assert s["class"] == "bug" and "BUG" in p.stdout, p.stdout[-2000:]
    assert _gate(d, "--allow", "rounding") == 4
    # relabelled `unknown` (so that `--allow unknown` passes it): the gate re-derives the bug from the
    # second pass's records - in summary.json alone, or in both summaries
    assert _edited(d, ["summary.json"], _relabel_unknown, "--allow", "unknown") == 2
    assert _edited(d, ["summary.json", "ops/summary.json"], _relabel_unknown, "--allow", "unknown") == 2

    ok = tmp_path / "ok"
    _, s = _compare(ok, SPEC + "chunks_ok")
    e = s["degrees"]["2"]
    assert not e.get("shape_break") and s["class"] == "rounding", e
    assert not any(f["cause"] in ("sharding-bug", "unknown") for f in e["findings"]), e["findings"]
    assert _gate(ok, "--allow", "rounding") == 0


def test_a_break_whose_module_read_bitwise_inputs_is_a_bug_in_pass_1(tmp_path):
    d = tmp_path / "par"
    _, s = _compare(d, SPEC + "parallel_floor")
    e = s["degrees"]["2"]
    assert e["shape_break"]["after"] == "s0/forward/mlp0.down/out#0/0", e["shape_break"]
    f = next(f for f in e["findings"] if f["key"] == BREAK)
    assert f["cause"] == "sharding-bug" and "from" not in f, f
    assert e["shape_break"]["by"] == "inputs-equal" and e["shape_break"]["producer"] == "block1", e["shape_break"]
    assert "block1's inputs and parameters were bitwise the reference's" in f["why"], f["why"]
    assert _gate(d, "--allow", "rounding") == 4

    def unjudged(s):  # `by` cut and the finding relabelled: the records still give it
        s["degrees"]["2"]["shape_break"]["by"] = None
        _relabel_unknown(s)

    assert _edited(d, ["summary.json"], unjudged, "--allow", "unknown") == 2

    ok = tmp_path / "par_ok"
    _, s = _compare(ok, SPEC + "parallel_ok")
    assert not s["degrees"]["2"].get("shape_break") and s["class"] == "rounding", s["degrees"]["2"]


def test_a_moe_dispatch_bug_behind_rounding_stays_unknown(tmp_path):
    d = tmp_path / "split"
    _, s = _compare(d, "py:tests/models/planted/moe_expert_calls.py:calls_split")
    e = s["degrees"]["2"]
    f = next(f for f in e["findings"] if f.get("shape_break"))
    assert f["cause"] == "unknown" and "at the reference it ran aten::nonzero" in f["why"], f
    assert e["shape_break"]["producer"] == "moe" and e["shape_break"]["by"] is None, e["shape_break"]
    assert s["class"] == "unknown"
    assert _gate(d, "--allow", "rounding") == 1


def test_the_float64_re_execution_notes_the_ops_through_which_a_value_decides_a_shape():
    """probes/value_shapes.py, through module_oracle's notes: what can size a tensor by a value is
    noted; an integer index and a softmax's max are not."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from tpdiag.probes.float64 import module_oracle

    class Call(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, x, *more):
            return self.f(x, *more)

    x = torch.randn(4, 8)
    cases = {
        "nonzero": (lambda x: x[(x.argmax(-1) == 0).nonzero().flatten()], ["aten::nonzero"]),
        "mask": (lambda x: x[x[:, 0] > 0], ["aten::index"]),
        "item": (lambda x: x[: int(x.argmax())], ["aten::_local_scalar_dense"]),
        "tolist": (lambda x: x[: x.argmax(-1).tolist()[0]], ["Tensor.tolist"]),
        "int index": (lambda x: x[torch.tensor([0, 2])] * 2, []),
        # one_hot checks its values' range by .item() (a read, noted: conservative, never a false BUG)
        "one_hot": (lambda x: x + F.one_hot(torch.tensor([1, 3, 0, 2]), 8), ["aten::_local_scalar_dense"]),
        "softmax": (lambda x: (x - x.max(-1, keepdim=True).values).exp(), []),
    }
    for name, (f, want) in cases.items():
        out, notes = module_oracle(Call(f), (x,), {})
        assert out is not None and notes.get("shaped", []) == want, (name, notes)
    # a custom op says nothing of its output's shape: counted (a user's fused dispatch may size it by routing)
    lib = torch.library.Library("hshape22_test", "FRAGMENT")
    lib.define("keep_pos(Tensor x) -> Tensor")
    lib.impl("keep_pos", lambda x: x[x[:, 0] > 0].clone(), "CompositeExplicitAutograd")
    out, notes = module_oracle(Call(lambda x: torch.ops.hshape22_test.keep_pos(x)), (x,), {})
    assert notes.get("shaped") == ["hshape22_test::keep_pos"], notes
    out, notes = module_oracle(Call(lambda x, n: x[:n]), (x, 2), {})
    assert notes.get("scalar_args") == 1 and "shaped" not in notes, notes
