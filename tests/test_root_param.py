"""A parameter the root owns itself in an HF-layout model (tests/models/planted/root_param.py: the body as
`model`, the head as `lm_head`, a per-channel output scale on the root), helper hreview18.

Since RECORD_FORMAT 3 the root records as "(root)" beside its `model` child; at 00909fb its own parameters
still recorded under "model" (model_walk.record_params, module_probe's grad hooks): the root's float64
backward, recorded under "(root)", judged no such grad and the body's has none, so scale_f (the scale sent
through Megatron's f: its grad, whole on every rank, summed over the ranks - 2x at TP=2) was listed as
not judged (class unknown, gate 1; at 85e6ea9 it read `rounding only`, gate 0). The root's own
parameters record under the root's record name now: the root's backward judges the grad, BUG
(sharding-bug) at (root), gate 4. The twin stays rounding."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/root_param.py:"
GRAD = "s0/backward/(root)/param_grad#0/out_scale"


def _run(tmp_path, case):
    d = tmp_path / case
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    g = run_cli("gate", str(d), "--allow", "rounding")
    return json.loads((d / "summary.json").read_text()), p.stdout, g


def test_root_owned_scale_grad_summed_over_ranks_is_a_bug_at_the_root(tmp_path):
    from tpdiag.records.causes import cause_class

    s, out, g = _run(tmp_path, "scale_f")
    e = s["degrees"]["2"]
    assert s["class"] == "bug" and e["class"] == "bug", (s["class"], e.get("not_judged"), out[-2000:])
    f = next((f for f in e.get("findings") or () if f.get("key") == GRAD), None)
    assert f is not None and f["cause"] == "sharding-bug" and f["module"] == "(root)", e.get("findings")
    # judged by the root's float64 backward (its own parameter's grad), far beyond rounding
    assert f["oracle"]["far"] and f["oracle"]["ratio"] > 1e3, f["oracle"]
    assert not e.get("not_judged"), e.get("not_judged")
    # no record of the body child `model` holds the root's parameter
    assert "s0/backward/model/param_grad#0/out_scale" not in out
    assert "BUG at backward: out_scale (param_grad; a parameter of the root module)" in out, out[-2000:]
    assert cause_class(f["cause"]) == "bug"
    both = g.stdout + g.stderr
    assert g.returncode == 4 and "module (root)" in both and "record param_grad out_scale" in both, both[-2000:]


def test_root_owned_scale_used_as_is_is_rounding(tmp_path):
    s, out, g = _run(tmp_path, "scale_ok")
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), e
    assert g.returncode == 0, (g.stdout + g.stderr)[-2000:]
