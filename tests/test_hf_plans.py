"""tpdiag's own TP plans for hf: architectures transformers leaves without one or with a wrong one
(tpdiag/models/plans_hf.py), run through the real CLI in gloo worlds on tiny checkpoints.

gpt_oss is checked with trained-like weights: every bias and the attention sinks non-zero (a
zero down_proj_bias would hide a bias counted once per rank). A right plan differs from TP=1 by
rounding only; each negative control - the same checkpoint with one entry deliberately wrong in
its config.json (which overrides the table) - is named a sharding-bug. doge ran into an SDPA shape
error under transformers' own plan; with the table's it runs, rounding only.
"""
import json

import pytest

from conftest import run_cli
from hf_configs import CONFIGS, write_tiny

pytest.importorskip("transformers", minversion="5")

BUG = ("sharding-bug", "rank-inconsistent-replica")


def _gpt_oss_checkpoint(d, quiet_attention=False, **plan_override):
    """A tiny gpt_oss directory with safetensors weights whose biases and sinks are non-zero.

    quiet_attention: o_proj's weight zeroed (its output is its bias at every degree, bitwise), so
    the experts are the first module to differ, with bitwise-equal inputs - where the float64
    oracle judges them (a module whose input already differs by rounding gets no verdict)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpdiag.models.plans_hf import GPT_OSS

    write_tiny("gpt_oss", d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn_like(p) * 0.5)
            if quiet_attention and name.endswith("o_proj.weight"):
                p.zero_()
    model.save_pretrained(d)
    if plan_override:
        cfg = json.loads((d / "config.json").read_text())
        cfg["base_model_tp_plan"] = {**GPT_OSS, **plan_override}
        (d / "config.json").write_text(json.dumps(cfg))
    return f"hf:{d}"


def _compare(spec, out, tp="1,2", *args):
    p = run_cli("compare", "--model", spec, "--tp", tp, "--out", str(out), "--format", "json",
                "--no-confirm", "--no-baseline", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


def _causes(deg: dict) -> set:
    return ({deg["first_divergence"]["cause"]} if deg.get("first_divergence") else set()) | \
        {f["cause"] for f in deg.get("findings", [])}


def test_gpt_oss_runs_on_tpdiags_plan_rounding_only(tmp_path):
    # the whole step at TP=4 (one head per rank: each rank's own attention sink; TP=2 runs in the
    # tests below and, under the fixes, in test_moe_fixes.py): bitwise until the first
    # row-parallel reduction, nothing beyond a rounding bound after it
    s = _compare(_gpt_oss_checkpoint(tmp_path / "m"), tmp_path / "run", "1,4")
    for d in ("4",):
        deg = s["degrees"][d]
        assert deg["status"] == "divergent", json.dumps(deg)[:1500]
        assert deg["first_divergence"]["module"] == "model.layers.0.self_attn.o_proj", deg["first_divergence"]
        causes = _causes(deg)
        assert causes and not causes & set(BUG), (d, causes)


def test_gpt_oss_experts_judged_rounding(tmp_path):
    # the experts first, on equal inputs: the float64 oracle calls them rounding (the twin of the
    # negative controls below, on the same checkpoint but for the plan entry)
    s = _compare(_gpt_oss_checkpoint(tmp_path / "m", quiet_attention=True), tmp_path / "run", "1,2",
                 "--forward-only")
    fd = s["degrees"]["2"]["first_divergence"]
    assert fd["module"] == "model.layers.0.mlp.experts" and fd.get("oracle"), fd
    assert not _causes(s["degrees"]["2"]) & set(BUG), json.dumps(s["degrees"]["2"])[:1500]


@pytest.mark.parametrize("wrong", [
    # down_proj_bias left replicated: moe_tp_experts sums it once per rank
    {"layers.*.mlp.experts.down_proj_bias": "replicate"},
    # gate/up as if packed [gate | up]: gpt_oss interleaves them, so the wrong columns pair up
    {"layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
     "layers.*.mlp.experts.gate_up_proj_bias": "packed_rowwise"},
])
def test_gpt_oss_wrong_plan_entry_is_a_bug(tmp_path, wrong):
    s = _compare(_gpt_oss_checkpoint(tmp_path / "m", quiet_attention=True, **wrong), tmp_path / "run",
                 "1,2", "--forward-only")
    fd = s["degrees"]["2"]["first_divergence"]
    assert fd["module"] == "model.layers.0.mlp.experts" and fd["cause"] in BUG, fd


def test_doge_runs_on_tpdiags_plan(tmp_path):
    from transformers import DogeConfig

    d = tmp_path / "doge"
    DogeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=128, keep_window_size=4,
               max_position_embeddings=64).save_pretrained(d)
    s = _compare(f"hf:{d}", tmp_path / "run")
    deg = s["degrees"]["2"]
    assert deg["status"] == "divergent" and not _causes(deg) & set(BUG), json.dumps(deg)[:1500]


def test_table_used_only_where_transformers_falls_short(tmp_path):
    from tpdiag.models.plans_hf import DOGE, GPT_OSS, table_plan

    assert table_plan("gpt_oss", {"embed_tokens": "embedding_rowwise"}) == GPT_OSS
    assert table_plan("doge", {"layers.*.self_attn.dt_proj": "rowwise"}) == DOGE
    # a transformers release that fixes doge's dt_proj keeps its own plan
    assert table_plan("doge", {"layers.*.self_attn.dt_proj": "colwise"}) is None
    assert table_plan("llama", {}) is None and "gpt_oss" in CONFIGS
