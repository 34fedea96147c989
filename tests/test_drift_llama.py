"""A later step in the drifted regime (tests/models/planted/drift_llama.py: the built-in tiny-llama in
bfloat16, --tp 1,2 --steps 3 --no-anchor, every layer's `w2` rows max-normed in place by its feed_forward's forward
from the second step on). Its forward at step 1 moved ~10x more than at step 0 (beyond
not_judged.DRIFT_MARGIN), so only step 0's unjudged grads are measured.

The correct twin (maxnorm_whole) read BUG at step 1 on main at a791568 (gate 4): `w2` was re-executed in
float64 from this side's parameters as the update recorded them, but the parent had rescaled them in
place before the call ("this side 3.74e-01 from it"). A parameter written since its record is now not
shipped (probes/own_params.written_since_recorded): rounding only, gate 0 with --allow rounding.

With --anchor (the default) each later step of the TP=2 world starts from the reference's state (runner/anchor.py):
the bug reads BUG at step 1 by float64 re-executions, the twin rounding, every step measured."""
import json

from conftest import run_cli, shared_run


def _run(tmp_path_factory, case, anchor=False):
    def make(out):
        p = run_cli("compare", "--model", f"py:tests/models/planted/drift_llama.py:{case}", "--tp", "1,2",
                    "--steps", "3", "--dtype", "bfloat16", "--no-confirm", "--no-baseline", "--out", str(out),
                    "--anchor" if anchor else "--no-anchor", env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, f"drift-llama-{case}{'-anchored' if anchor else ''}", make)
    if out not in _GATES:  # one gate of a run (read by two tests for maxnorm_local): ~4 CPU s each
        g = run_cli("gate", str(out), "--allow", "rounding")
        _GATES[out] = (g.returncode, g.stdout + g.stderr)
    return out, json.loads((out / "summary.json").read_text()), *_GATES[out]


_GATES: dict = {}


def _bugs(d):
    return [f for f in [d["first_divergence"], *d.get("findings", ())] if f.get("cause") == "sharding-bug"]


def test_the_correct_twin_in_the_drifted_regime_is_rounding(tmp_path_factory):
    from tpdiag.diff.engine import diff_degree
    from tpdiag.diff.measured_steps import measured_steps
    from tpdiag.records.store import RecordSet

    out, s, gate, text = _run(tmp_path_factory, "maxnorm_whole")
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not _bugs(d), d.get("findings")
    assert gate == 0, text
    # the drifted regime: step 1's forward moved beyond DRIFT_MARGIN x step 0's
    dd = diff_degree(RecordSet(str(out / "tp1")), RecordSet(str(out / "tp2")), "tp2")
    assert measured_steps(dd.rows) == {"0"}


def test_a_later_step_mistake_in_the_drifted_regime_is_a_bug_at_its_step(tmp_path_factory):
    _, s, gate, text = _run(tmp_path_factory, "maxnorm_local")
    d = s["degrees"]["2"]
    assert s["class"] == "bug" and gate == 4, text
    bugs = _bugs(d)
    assert bugs and min(f["step"] for f in bugs) == 1, bugs
    assert {f["key"].split("/")[2] for f in bugs if f["step"] == 1} <= {f"layers.{i}.feed_forward.w2" for i in range(2)}


def test_the_later_step_mistake_is_judged_without_the_drift(tmp_path_factory):
    # re-anchored: step 1 starts from the reference's weights, so w2's float64 re-execution judges
    # it as at step 0 (drifted, it read BUG only 1.03x beyond a rounding bound, no float64 verdict)
    _, s, gate, text = _run(tmp_path_factory, "maxnorm_local", anchor=True)
    assert s["class"] == "bug" and gate == 4, text
    bugs = [f for f in _bugs(s["degrees"]["2"]) if f["step"] == 1]
    assert {f["key"].split("/")[2] for f in bugs if f["phase"] == "forward"} == \
        {f"layers.{i}.feed_forward.w2" for i in range(2)}, bugs
    assert bugs and all((f.get("oracle") or {}).get("far") for f in bugs), bugs


def test_the_correct_twin_re_anchored_is_rounding_at_every_step(tmp_path_factory):
    from tpdiag.diff.engine import diff_degree
    from tpdiag.diff.measured_steps import measured_steps
    from tpdiag.records.store import RecordSet

    out, s, gate, text = _run(tmp_path_factory, "maxnorm_whole", anchor=True)
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not _bugs(d), d.get("findings")
    assert gate == 0, text
    assert json.loads((out / "tp2" / "world.json").read_text())["anchor"] == {"steps": [1, 2]}
    # no drift: every step's forward moved as step 0's did
    dd = diff_degree(RecordSet(str(out / "tp1")), RecordSet(str(out / "tp2")), "tp2")
    assert measured_steps(dd.rows) == {"0", "1", "2"}


# the records before the first row-parallel reduction: bitwise at step 0 (the first divergence is
# layers.0.attention.wo's output), read from the colwise shards of wq/wk/wv and the replicated rest
_BEFORE_WO = ("tok_embeddings", "layers.0.attention_norm", "layers.0.attention.wq", "layers.0.attention.wk",
              "layers.0.attention.wv")


def _forward_outs(out):
    from tpdiag.diff.engine import diff_degree
    from tpdiag.records.store import RecordSet

    dd = diff_degree(RecordSet(str(out / "tp1")), RecordSet(str(out / "tp2")), "tp2")
    return {(r["step"], r["module"]): r["bitwise"] for r in dd.rows
            if (r["phase"], r["kind"]) == ("forward", "out") and r["module"] in _BEFORE_WO}


def test_a_re_anchored_step_reads_the_references_weights_bitwise(tmp_path_factory):
    """The reference's state re-sharded onto TP=2's layout: each later step's records up to the first
    reduction equal the reference's bit for bit, as step 0's do; drifted (no --anchor), they differ."""
    anchored = _forward_outs(_run(tmp_path_factory, "maxnorm_whole", anchor=True)[0])
    drifted = _forward_outs(_run(tmp_path_factory, "maxnorm_whole")[0])
    assert set(anchored) == {(st, m) for st in range(3) for m in _BEFORE_WO}
    assert all(anchored.values()), anchored
    assert all(drifted[(0, m)] for m in _BEFORE_WO), drifted
    assert not any(drifted[(st, m)] for st in (1, 2) for m in _BEFORE_WO), drifted  # the negative control


def test_a_parameter_written_since_its_record_is_not_swapped_for_the_shipped_value():
    import torch

    from tpdiag.probes.own_params import mark_recorded, shipped_for, swapped, written_since_recorded
    from tpdiag.records.side_params import source_key

    mod = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    shipped = {source_key(1, "m.0", "weight"): torch.ones(4, 4)}
    mark_recorded(mod)
    got = shipped_for(mod, "m", 1, shipped)
    assert got is not None and torch.equal(got[mod[0].weight], torch.ones(4, 4))
    with swapped(got):  # the swap and its restore are no write
        pass
    assert written_since_recorded(mod) == []
    with torch.no_grad():
        mod[0].weight.mul_(0.5)  # a parent's in-place constraint before the call
    assert written_since_recorded(mod) == ["0.weight"]
    assert shipped_for(mod, "m", 1, shipped) is None
    mark_recorded(mod)  # the next update's record
    assert shipped_for(mod, "m", 1, shipped) is not None


def test_a_state_no_layout_places_is_not_loaded():
    """A plain local tensor shaped unlike the reference's (a hand-sharded layer): no layout says which
    part is this rank's, so nothing is loaded and the world says why (its later steps stay drifted)."""
    import torch

    from tpdiag.runner import anchor

    ref = torch.nn.Linear(4, 8, bias=False)
    opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    ref(torch.ones(2, 4)).sum().backward()
    opt.step()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = anchor.state_file(d, 1)
        anchor.save(path, ref, opt)
        same = torch.nn.Linear(4, 8, bias=False)
        same_opt = torch.optim.AdamW(same.parameters(), foreach=False)
        same(torch.ones(2, 4)).sum().backward()
        same_opt.step()
        assert anchor.load(path, same, same_opt) is None
        assert torch.equal(same.weight, ref.weight)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(same_opt.state[same.weight][k], opt.state[ref.weight][k])
        half = torch.nn.Linear(4, 4, bias=False)  # this rank's rows, cut by the user's own code
        half_opt = torch.optim.AdamW(half.parameters(), foreach=False)
        before = half.weight.detach().clone()
        why = anchor.load(path, half, half_opt)
        assert why and "shaped [4, 4] here, [8, 4] at the reference" in why, why
        assert torch.equal(half.weight, before)
