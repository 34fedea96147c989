"""Megatron's tied vocab-parallel embedding written by hand (tests/models/planted/tied_vocab.py): one
module holds the weight and the model reads it through its methods (`vocab.embed`, `vocab.logits`),
never its forward - so nothing re-executes that module's backward in float64.

Main at 85e6ea9: tied_dfn (the lookup summed with torch.distributed.nn.functional.all_reduce, whose
backward all-reduces the grad again: the embedding's share of the tied grad TP times itself, the weight
grad 0.55 of its norm off) read `rounding only` in compare, no finding, no not_judged; `gate --allow
rounding` exited 2 calling the run "edited after the run" (its confirmation's records, cut). The weight
grad is now listed as not judged (diff/not_judged._weight_grads): class unknown, gate 1 for the right
reason. Its twin with Megatron's g (identity backward) stays rounding, gate 0 - in float16 too: at
00909fb tpdiag's own AdamW (eps 1e-8, 0 in float16) wrote NaN into the twin's weights at the reference and
TP=2 alike, and it read NON-FINITE (runner/update.optimizer).

The listed grad is a weight's: compare, the gate and the report called it "1 activation grad" and the
gate "record grad_out -"; they name it "weight grad of vocab.weight" and "record param_grad weight" now.
"""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/tied_vocab.py:"
GRAD = "s0/backward/vocab/param_grad#0/weight"


def _run(tmp_path, case, *more):
    d = tmp_path / case
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--out", str(d), *more,
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
    # a weight's grad in words: never an activation grad, nor the gate's "record grad_out"
    assert nj.get("weight_grads") == nj["records"] == 1, nj
    assert f"{GRAD} (weight grad of vocab.weight: " in out and "(1 weight grad, up to" in out, out[-2500:]
    assert "activation grad" not in out, out[-2500:]
    assert "record param_grad weight" in both and "1 weight grad past the first divergence" in both, both[-2000:]
    assert "grad_out" not in both and "activation grad" not in both, both[-2000:]
    assert run_cli("report", str(tmp_path / "tied_dfn")).returncode == 0
    import html

    page = html.unescape((tmp_path / "tied_dfn" / "report.html").read_text())
    assert "Not judged past the first divergence: 1 weight grad, up to" in page, page[-3000:]
    assert "Not judged: weight grads past the first divergence moved beyond rounding" in page
    assert "weight grad of vocab.weight" in page and "activation grad" not in page


def test_tied_with_megatrons_g_is_rounding(tmp_path):
    s, out, g = _run(tmp_path, "tied_ok")
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), e
    assert g.returncode == 0, (g.stdout + g.stderr)[-2000:]


def test_tied_with_megatrons_g_is_rounding_in_float16(tmp_path):
    """float16, one step: the optimizer's update at every degree stays finite (no NaN at the reference)."""
    s, out, g = _run(tmp_path, "tied_ok", "--dtype", "float16", "--no-confirm")
    e = s["degrees"]["2"]
    assert "NON-FINITE" not in out and not e.get("nonfinite"), (e.get("nonfinite"), out[-2000:])
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), e
    assert g.returncode == 0, (g.stdout + g.stderr)[-2000:]
