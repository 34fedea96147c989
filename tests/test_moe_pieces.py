"""transformers' MoE experts along the RL axes (micro-batch size, decode): inside the experts module
the rows are the call's (token, slot) pairs grouped by expert, so a micro-batch's or a decode call's
rows are no slice of the whole batch's. tpdiag concatenated them as if they were and compared them
row by row: `compare --tp 1 --micro-batch 2,1` and `--mode prefill,decode` on qwen3_moe, OLMoE,
PhiMoE read BUG at `mlp.experts :: aten::index` (the dispatch's gather, 30-10^6x "beyond rounding")
with the logprobs rounding apart (bf16 OLMoE: bitwise). The experts module is now compared at its boundary there (its
input, output and grads are per token), and says so; a batch-coupled MoE (the planted capacity
bug, tests/test_batch_coupled.py) still reads BUG at its module."""
import json

import pytest

from conftest import run_cli
from hf_configs import write_tiny

pytest.importorskip("transformers", minversion="5")
TINY = ("--tp", "1", "--seq-len", "8", "--forward-only", "--no-baseline", "--no-confirm", "--format", "json")


@pytest.mark.parametrize("axis", [("--micro-batch", "2,1", "--batch-size", "2"),
                                  ("--mode", "prefill,decode", "--batch-size", "2")])
def test_moe_experts_across_pieces_are_compared_at_their_boundary(tmp_path, axis):
    spec = write_tiny("qwen3_moe", tmp_path / "m")
    p = run_cli("compare", "--model", spec, *TINY, *axis, "--out", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    (label, e), = s["configurations"].items()
    assert e["logprobs"]["max_abs"] < 1e-5, e["logprobs"]  # the tokens' logprobs: rounding apart
    assert s["class"] != "bug" and e.get("class") != "bug", (e.get("first_divergence"), e.get("findings"))
    assert not e["missing"] and not e["unmatched"], (e["missing"], e["unmatched"])
    blocks = e.get("per_piece") or {}
    assert sorted(blocks) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], blocks
    assert all("model.layers.0.mlp.experts.act_fn" in v["inside"] for k, v in blocks.items() if ".0." in k)
    assert all("compared at its boundary only" in v["why"] for v in blocks.values())
    # printed once per configuration, not once per experts module (one per layer in a deep MoE)
    from tpdiag.cli.common import emit_summary
    from tpdiag.records.rundir import read_summary
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        emit_summary(read_summary(str(tmp_path / "r")), "text")
    said = [x for x in out.getvalue().splitlines() if "compared at its boundary only" in x]
    assert len(said) == 1 and "model.layers.0.mlp.experts, model.layers.1.mlp.experts: MoE experts" in said[0], said
    # the experts module's own output is still compared (in float32 at micro-batch 1 it is where the
    # pieces' other GEMM shapes first show, judged on its own inputs as rounding)
    rows = [r for r in open(tmp_path / "r" / "diff.csv").read().splitlines()
            if ",model.layers.0.mlp.experts,out," in r and r.startswith(label + ",")]
    assert rows, label
    fd = e["first_divergence"]
    assert e["class"] == "rounding" and fd["cause"] == "batch-variant-kernel", fd
    if axis[0] == "--micro-batch":
        assert fd["module"] == "model.layers.0.mlp.experts" and fd["kind"] == "out", fd
    g = run_cli("gate", str(tmp_path / "r"), "--allow", "rounding")
    assert g.returncode == 0, g.stdout + g.stderr
