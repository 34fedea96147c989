"""A later step in the drifted regime (tests/models/planted/drift_llama.py: the built-in tiny-llama in
bfloat16, --tp 1,2 --steps 3, every layer's `w2` rows max-normed in place by its feed_forward's forward
from the second step on). Its forward at step 1 moved ~10x more than at step 0 (beyond
not_judged.DRIFT_MARGIN), so only step 0's unjudged grads are measured.

The correct twin (maxnorm_whole) read BUG at step 1 on main at a791568 (gate 4): `w2` was re-executed in
float64 from this side's parameters as the update recorded them, but the parent had rescaled them in
place before the call ("this side 3.74e-01 from it"). A parameter written since its record is now not
shipped (probes/own_params.written_since_recorded): rounding only, gate 0 with --allow rounding."""
import json

import pytest

from conftest import run_cli, shared_run


def _run(tmp_path_factory, case):
    def make(out):
        p = run_cli("compare", "--model", f"py:tests/models/planted/drift_llama.py:{case}", "--tp", "1,2",
                    "--steps", "3", "--dtype", "bfloat16", "--no-confirm", "--no-baseline", "--out", str(out),
                    env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, f"drift-llama-{case}", make)
    if out not in _GATES:  # one gate of a run (read by two tests for maxnorm_local): ~4 CPU s each
        g = run_cli("gate", str(out), "--allow", "rounding")
        _GATES[out] = (g.returncode, g.stdout + g.stderr)
    return out, json.loads((out / "summary.json").read_text()), *_GATES[out]


_GATES: dict = {}


def _bugs(d):
    return [f for f in [d["first_divergence"], *d.get("findings", ())] if f.get("cause") == "sharding-bug"]


def test_the_correct_twin_in_the_drifted_regime_is_rounding(tmp_path_factory):
    from tpdiag.diff.engine import diff_degree
    from tpdiag.diff.not_judged import measured_steps
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


@pytest.mark.xfail(strict=True, reason="not built: re-anchoring a later step at the reference's state "
                   "(docs/causes.md 'Not covered'); w2 at step 1 is judged by its rounding bound from drifted "
                   "inputs, 1.03x beyond it - no float64 re-execution separates the bug from the drift")
def test_the_later_step_mistake_is_judged_without_the_drift(tmp_path_factory):
    _, s, _, _ = _run(tmp_path_factory, "maxnorm_local")
    bugs = [f for f in _bugs(s["degrees"]["2"]) if f["step"] == 1]
    assert bugs and all((f.get("oracle") or {}).get("far") for f in bugs), bugs


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
