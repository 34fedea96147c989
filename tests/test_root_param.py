"""A parameter the root owns itself in an HF-layout model (tests/models/planted/root_param.py: the body as
`model`, the head as `lm_head`, a per-channel output scale on the root), helper hreview18.

Since RECORD_FORMAT 3 the root records as "(root)" while its own parameters still record under "model"
(model_walk.record_params, equal_inputs.in_subtree), the body child's name: the root's float64 backward,
recorded under "(root)", judges no such grad and the body's has none. At 85e6ea9 scale_f (the scale sent
through Megatron's f: its grad, whole on every rank, summed over the ranks - 2x at TP=2) read
`rounding only`, gate --allow rounding 0. diff/not_judged._weight_grads (hplant18) lists it now as not
judged (class unknown, gate 1): this test holds that line; a BUG there needs the root's own parameters
recorded under the root's name. The twin stays rounding."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/root_param.py:"
GRAD = "s0/backward/model/param_grad#0/out_scale"


def _run(tmp_path, case):
    d = tmp_path / case
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    g = run_cli("gate", str(d), "--allow", "rounding")
    return json.loads((d / "summary.json").read_text()), p.stdout, g


def test_root_owned_scale_grad_summed_over_ranks_is_not_rounding(tmp_path):
    s, out, g = _run(tmp_path, "scale_f")
    e = s["degrees"]["2"]
    assert s["class"] != "rounding" and e["class"] != "rounding", (s["class"], e)
    nj = e.get("not_judged") or {}
    assert GRAD in nj.get("keys", []) and nj["rel_l2"] > 0.5, nj
    assert "rounding only" not in out, out[-1500:]
    assert g.returncode == 1 and "edited after the run" not in g.stdout + g.stderr, (g.stdout + g.stderr)[-2000:]


def test_root_owned_scale_used_as_is_is_rounding(tmp_path):
    s, out, g = _run(tmp_path, "scale_ok")
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), e
    assert g.returncode == 0, (g.stdout + g.stderr)[-2000:]
