"""Architectures a new user loads with plain `from_pretrained` (tiny random configs,
`save_pretrained`), run as `hf:` and as the user's own `py:` plan:

- OLMo2's q_norm / k_norm normalise the WHOLE q (k) projection, every head at once. With q
  column-sharded, a norm over the rank's own columns (its weight cut like q) is another function:
  BUG at q_norm, gate 4. The same checkpoint with q/k/v gathered, or with the norm run on DTensors
  (the mean reduced across ranks), is the model: rounding only, gate 0 with --allow rounding.
- tpdiag's TP=1 model of an `hf:` OLMo2, Gemma2 (soft-capping, sliding window, sandwich norms),
  Granite (multipliers), StableLM (partial rotary, per-head q/k LayerNorms), OLMo3, EXAONE-4 and
  Seed-OSS checkpoint computes `from_pretrained`'s logits bit for bit, in float32 and bf16, and in
  train mode (compare's step) with the config's dropout off, whatever its name.
- StableLM (no transformers plan; per-head q/k LayerNorms in a ModuleList) under the user's own
  plan: each rank keeping its own heads' norms is correct - rounding only. It read BUG (gate 4):
  the norms differ per rank, so self_attn was compared at its boundary, and the column-parallel
  q/k/v/o_proj, whose DTensor shards differ per rank by construction, were taken for per-rank
  modules too and their local shards checked against the reference's whole weights ("none of
  the reference's parameters"). The norms left whole (heads 2, 3 normalised with heads 0, 1's
  norms on rank 1) is a BUG.
- A model with no TP plan (StableLM) runs a compare whose every configuration is TP=1.
- Where no fix removes the cause of any divergent degree (the DTensor norm's
  shape-dependent-kernel), `what to do` says `--fix auto` would not remove it - it offered
  `--fix auto` under "no fix to confirm it with"."""
import json
import os

import pytest
import torch

from conftest import ROOT, run_cli

pytest.importorskip("transformers", minversion="5")

USER = os.path.join(ROOT, "tests", "models", "user_olmo2.py")
USER_STABLELM = os.path.join(ROOT, "tests", "models", "user_stablelm.py")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)
ARCHS = {
    "olmo2": {},
    "gemma2": dict(head_dim=8, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.3,
                    logits_scaling=8.0),
    "stablelm": dict(qk_layernorm=True, partial_rotary_factor=0.25),
    # the 2026-12-02 sweep (docs/models-zoo.md): full-width q/k norms after the projections
    # (olmo3), per-head norms after them (exaone4), residual dropout off in eval (seed_oss)
    "olmo3": {}, "exaone4": dict(head_dim=8), "seed_oss": dict(head_dim=8),
}


def _save(path, kind):
    """A checkpoint as a user has one: save_pretrained of a random init, its norm weights moved off
    their init (ones) so that a norm applied to the wrong columns changes the forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **ARCHS[kind]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("olmo2") / "ckpt", "olmo2")


@pytest.fixture(scope="module")
def stablelm(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("stablelm") / "ckpt", "stablelm")


def _compare(olmo2, tmp_path, func, user=USER, var="USER_OLMO2_DIR"):
    out = str(tmp_path / func)
    p = run_cli("compare", "--model", f"py:{user}:{func}", "--tp", "1,2", "--no-confirm", "--no-baseline",
                "--format", "json", "--out", out, env={var: olmo2})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout), out


def _gate(out, *args):
    return run_cli("gate", out, *args, env={}).returncode


def test_olmo2_norm_over_the_rank_columns_is_a_bug(olmo2, tmp_path):
    s, out = _compare(olmo2, tmp_path, "shard_norm")
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert d["class"] == "bug", json.dumps(d)[:1500]
    assert fd["module"] == "model.layers.0.self_attn.q_norm" and fd["cause"] == "sharding-bug", fd
    assert fd["bound_ratio"] > 1e3, fd
    assert _gate(out) == 4 and _gate(out, "--allow", "rounding") == 4


@pytest.mark.parametrize("func", ["gathered", "dtensor_norm"])
def test_olmo2_norm_over_every_head_is_rounding(olmo2, tmp_path, func):
    s, out = _compare(olmo2, tmp_path, func)
    d = s["degrees"]["2"]
    assert d["status"] == "divergent" and d["class"] == "rounding", json.dumps(d)[:1500]
    assert not [f for f in d["findings"] if f.get("cause") in ("sharding-bug", "rank-inconsistent-replica")]
    assert _gate(out, "--allow", "rounding") == 0
    from tpdiag.fixes.registry import fixes_for_cause

    fd = d["first_divergence"]
    if fixes_for_cause(fd["cause"], fd.get("op")):   # gathered: row-parallel-reduction
        assert "`tpdiag compare --fix auto` applies the fixes" in s["what_to_do"], s["what_to_do"]
    else:  # dtensor_norm on this CPU: shape-dependent-kernel, which no fix covers - the advice
        # offered `--fix auto` (under "no fix to confirm it with" where confirmed)
        assert "would not remove it" in s["what_to_do"] and "applies the fixes" not in s["what_to_do"], s["what_to_do"]


def test_stablelm_per_head_norms_cut_with_the_heads_is_rounding(stablelm, tmp_path):
    s, out = _compare(stablelm, tmp_path, "norms_cut", USER_STABLELM, "USER_STABLELM_DIR")
    d = s["degrees"]["2"]
    assert d["status"] == "divergent" and d["class"] == "rounding", json.dumps(d)[:2000]
    # the sharded projections are compared as shards (not left out with the per-rank norms)
    assert d["first_divergence"]["module"] == "model.layers.0.self_attn.o_proj", d["first_divergence"]
    block = d["per_rank"]["model.layers.0.self_attn"]
    assert not any(m.endswith("_proj") for m in block["inside"]), block
    assert "not_the_reference" not in block, block
    assert _gate(out, "--allow", "rounding") == 0


def test_stablelm_per_head_norms_left_whole_is_a_bug(stablelm, tmp_path):
    s, out = _compare(stablelm, tmp_path, "heads_only", USER_STABLELM, "USER_STABLELM_DIR")
    d = s["degrees"]["2"]
    assert d["class"] == "bug", json.dumps(d)[:1500]
    assert "q_layernorm" in d["first_divergence"]["module"], d["first_divergence"]
    assert _gate(out) == 4


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


def test_a_model_with_no_tp_plan_runs_a_tp1_only_compare(tmp_path):
    # StableLM has no base_model_tp_plan: refused at TP > 1 before launch (a "TP=2" run of it would
    # split nothing). A compare whose every configuration is TP=1 (micro-batch sizes) applies no
    # plan - yet each world raised "StableLmForCausalLM has no tensor-parallel plan ... it cannot
    # run at TP > 1" and the run read inconclusive
    path = _save(tmp_path / "stablelm", "stablelm")
    p = run_cli("compare", "--model", f"hf:{path}", "--tp", "1", "--micro-batch", "2,1", "--batch-size", "2",
                "--no-confirm", "--no-baseline", "--format", "json", "--out", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["status"] in ("bitwise", "divergent"), json.dumps(s["degrees"])[:1500]
    assert all(d["status"] != "failed" for d in s["degrees"].values()), json.dumps(s["degrees"])[:1500]
    assert s["class"] != "bug"


@pytest.mark.parametrize("kind,extra", [("seed_oss", dict(head_dim=8)),          # residual_dropout 0.1
                                        ("phi", dict(resid_pdrop=0.1, embd_pdrop=0.1))])
def test_tp1_training_model_runs_no_dropout(tmp_path, kind, extra):
    # compare's step runs the model in train mode; tpdiag zeroes the config's dropout, but only
    # under three names: Seed-OSS's residual_dropout (its default 0.1) stayed on and the TP=1
    # logits were 0.24 from from_pretrained's forward (a dropout mask, not the model)
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpdiag.config import WorldConfig
    from tpdiag.runner.build import build_model

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **extra)).save_pretrained(tmp_path / kind)
    path = str(tmp_path / kind)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ours = build_model(WorldConfig.of(model="hf:" + path, degree=1, label="1", out_dir=""), torch.device("cpu"), 1)[1]
    assert ours.training
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert torch.equal(got, want), (kind, (got - want).abs().max().item())
