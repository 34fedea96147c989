"""Hugging Face MoE checkpoints (transformers 5's fused 3D experts) loaded with plain
`from_pretrained`, under a user's own TP plan (tests/models/user_moe.py):

- experts tensor-parallel within each expert, cut as `packed_colwise` cuts them (each rank's gate
  rows AND its up rows of the stacked `gate_up_proj`) is correct. It read BUG at init
  (`param_init gate_up_proj`, sharding-bug, gate 4): the markerless shards were gathered as one
  contiguous cut, [g0; u0; g1; u1] against the reference's [g0; g1; u0; u1]
  (diff/packed_shards.py learns the packed layout from the initial weights).
- the naive contiguous cut of [gate; up] (rank 0 every gate row, rank 1 every up row) is a BUG at
  the experts' forward; a router on the rank's own hidden columns with no reduction is a BUG at the
  router; qwen2_moe's sigmoid shared-expert gate on a partial logit is a BUG at that gate.
- tpdiag's TP=1 model of an `hf:` checkpoint computes `from_pretrained`'s logits bit for bit."""
import json
import os

import pytest
import torch

from conftest import ROOT, run_cli

pytest.importorskip("transformers", minversion="5")

USER = os.path.join(ROOT, "tests", "models", "user_moe.py")
SMALL = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)
ARCHS = {"qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32),
         "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
         "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2)}


def _save(path, kind):
    """save_pretrained of a random init; norms moved off ones, the router spread so that top-2
    picks are decided by margins far above rounding"""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **ARCHS[kind]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = _save(tmp_path_factory.mktemp(kind) / "ckpt", kind)
        return made[kind]
    return get


def _compare(path, tmp_path, func):
    out = str(tmp_path / func)
    p = run_cli("compare", "--model", f"py:{USER}:{func}", "--tp", "1,2", "--no-confirm", "--no-baseline",
                "--format", "json", "--out", out, env={"USER_MOE_DIR": path})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)["degrees"]["2"], out


def _gate(out, *args):
    return run_cli("gate", out, *args, env={}).returncode


@pytest.mark.parametrize("kind,func", [("mixtral", "experts_tp"), ("qwen2_moe", "attn_only")])
def test_correct_moe_plans_read_rounding(ckpt, tmp_path, kind, func):
    d, out = _compare(ckpt(kind), tmp_path, func)
    assert d["status"] == "divergent" and d["class"] == "rounding", json.dumps(d)[:2000]
    assert not [f for f in d["findings"] if f.get("cause") in ("sharding-bug", "rank-inconsistent-replica")], d["findings"]
    assert _gate(out, "--allow", "rounding") == 0


@pytest.mark.parametrize("kind,func,where,cause", [
    ("mixtral", "packed_naive", "model.layers.0.mlp.experts", "sharding-bug"),
    ("granitemoe", "router_partial", "model.layers.0.block_sparse_moe.router", "rank-inconsistent-replica"),
    ("qwen2_moe", "shared_gate_partial", "model.layers.0.mlp.shared_expert_gate", "rank-inconsistent-replica"),
])
def test_buggy_moe_plans_are_bugs(ckpt, tmp_path, kind, func, where, cause):
    d, out = _compare(ckpt(kind), tmp_path, func)
    assert d["class"] == "bug", json.dumps(d)[:2000]
    # the forward finding no other follows from: the planted module
    roots = [(f["module"], f["cause"]) for f in d["findings"] if f["phase"] == "forward" and not f.get("follows")]
    assert roots == [(where, cause)], d["findings"]
    assert _gate(out, "--allow", "rounding") == 4


@pytest.mark.parametrize("kind", sorted(ARCHS))
def test_tp1_logits_are_from_pretrained_bitwise(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from tpdiag.config import WorldConfig
    from tpdiag.runner.build import build_model

    path = _save(tmp_path / kind, kind)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32", "bfloat16"):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        cfg = WorldConfig.of(model="hf:" + path, degree=1, label="1", out_dir="", dtype=dtype)
        ours = build_model(cfg, torch.device("cpu"), 1)[1].eval()
        with torch.no_grad():
            want, got = ref(ids).logits, ours(ids).logits
        assert torch.equal(got, want), (kind, dtype, (got.float() - want.float()).abs().max().item())
