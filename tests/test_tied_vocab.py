"""Megatron's tied vocab-parallel embedding written by hand (tests/models/planted/tied_vocab.py): one
module holds the weight and the model reads it through its methods (`vocab.embed`, `vocab.logits`),
never its forward - so nothing re-executes that module's backward in float64.

Main at 85e6ea9: tied_dfn (the lookup summed with torch.distributed.nn.functional.all_reduce, whose
backward all-reduces the grad again: the embedding's share of the tied grad TP times itself, the weight
grad 0.55 of its norm off) read `rounding only` in compare, no finding, no not_judged; `gate --allow
rounding` exited 2 calling the run "edited after the run" (its confirmation's records, cut). The weight
grad is now listed as not judged (diff/not_judged._weight_grads): class unknown, gate 1 for the right
reason. Its twin with Megatron's g (identity backward) stays rounding, gate 0.
"""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/tied_vocab.py:"
GRAD = "s0/backward/vocab/param_grad#0/weight"


def _run(tmp_path, case):
    d = tmp_path / case
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    g = run_cli("gate", str(d), "--allow", "rounding")
    return json.loads((d / "summary.json").read_text()), p.stdout, g


def test_tied_grad_doubled_by_dfn_all_reduce_is_not_rounding(tmp_path):
    s, out, g = _run(tmp_path, "tied_dfn")
    e = s["degrees"]["2"]
    assert s["class"] == "unknown" and e["class"] == "unknown", (s["class"], e)
    nj = e.get("not_judged") or {}
    assert GRAD in nj.get("keys", []) and nj["rel_l2"] > 0.2, nj
    assert "rounding only" not in out, out[-1500:]
    both = g.stdout + g.stderr
    assert g.returncode == 1 and "edited after the run" not in both and "module vocab" in both, both[-2000:]


def test_tied_with_megatrons_g_is_rounding(tmp_path):
    s, out, g = _run(tmp_path, "tied_ok")
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), e
    assert g.returncode == 0, (g.stdout + g.stderr)[-2000:]
