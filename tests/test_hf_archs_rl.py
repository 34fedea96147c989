"""An RL team's run on architectures the other hf: tests do not load from a checkpoint: Phi-3 (fused
qkv_proj and gate_up_proj), Granite (embedding/residual/attention multipliers, logits scaling),
GPT-NeoX (fused per-head query_key_value, partial rotary, parallel residual), Starcoder2 (LayerNorm
and Linear biases, a sliding window shorter than the sequences) and Cohere with
use_qk_norm (Command R+: per-head LayerNorm q/k norms, logit_scale, tied embeddings, parallel
attention + MLP). A tiny checkpoint saved in bf16 with save_pretrained, loaded as the trainer
loads it (from_pretrained(DIR, dtype=torch.bfloat16)), one generate() call with sampling:

- generate()'s raw logprobs are tpdiag's TP=1 decode at the engine's batch bit for bit, and
  tpdiag's prefill is the user's own forward of from_pretrained's model bit for bit;
- `compare --tp 1,2 --fix all` (bf16, the whole step) is bitwise.
Cohere with use_qk_norm could not run at TP=2 under transformers' plan (its q/k norm weights are
[heads, head_dim], left whole while the heads are cut: a shape error); tpdiag's plan cuts them like
the heads (models/plans_hf.py), and invariant-norm-grad sums their weight grads head by head.
"""
import json

import pytest
import torch

from conftest import run_cli
from rl_team import SAMPLE, engine, picked, rollout, save_bf16, trainer_logits

pytest.importorskip("transformers", minversion="5")

ARCHS = {
    "phi3": {},
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                    attention_multiplier=0.0078125),
    "gpt_neox": dict(partial_rotary_factor=0.25, use_parallel_residual=True, num_key_value_heads=4),
    "cohere": dict(use_qk_norm=True, logit_scale=0.0625, tie_word_embeddings=True),
    "starcoder2": dict(sliding_window=4, use_bias=True),
}


def _compare(path, out, *args):
    p = run_cli("compare", "--model", "hf:" + path, "--tp", "1,2", "--out", str(out), "--format", "json",
                "--no-baseline", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def _trainer_forward(model, rows):
    """The user's own logprobs of each row: from_pretrained's model on the right-padded batch."""
    lsm = trainer_logits(model, rows).float().log_softmax(-1)
    return [picked(lsm, i, x) for i, x in enumerate(rows)]


@pytest.mark.parametrize("kind", list(ARCHS))
def test_rollout_and_trainer_are_transformers_bits_and_fix_all_is_bitwise(tmp_path, kind):
    path = save_bf16(kind, tmp_path / kind, **ARCHS[kind])
    files, model = engine(path, **SAMPLE)
    rows = files["raw"]
    s, got = rollout(tmp_path, rows, path)
    m = s["configurations"]["tp1-mb8-decode-none"]["metrics"]
    assert m["exact_tokens"] == m["tokens"] == sum(len(x["logprobs"]) for x in rows), (kind, m)
    assert s["closest"]["reproduced"] is True
    for i, want in enumerate(_trainer_forward(model, rows)):
        assert torch.equal(want, got["tp1-mb8-prefill-none"][i]), (kind, i)
    # negative control: the prefill is not the engine's decode, and the comparison can tell
    assert s["configurations"]["tp1-mb8-prefill-none"]["metrics"]["exact_tokens"] < m["tokens"]
    c = _compare(path, tmp_path / "fixed", "--dtype", "bfloat16", "--fix", "all", "--no-confirm")
    assert c["status"] == "bitwise", json.dumps(c["degrees"])[:1500]


def test_cohere_qk_norm_plan_entries_only_where_the_config_has_them():
    from transformers import AutoConfig

    from tpdiag.models.plans_hf import COHERE_QK_NORM, table_plan

    cfg = AutoConfig.for_model("cohere", use_qk_norm=True)
    plan = dict(cfg.base_model_tp_plan)
    assert table_plan("cohere", plan, cfg) == {**plan, **COHERE_QK_NORM}
    assert table_plan("cohere", plan, AutoConfig.for_model("cohere", use_qk_norm=False)) is None
    # a plan that already names the norms (a transformers release that shards them) is used as it is
    assert table_plan("cohere", {**plan, "layers.*.self_attn.q_norm": "replicate"}, cfg) is None


def test_cohere_qk_norm_runs_at_tp2_and_its_norm_grad_is_found_and_fixed(tmp_path):
    path = save_bf16("cohere", tmp_path / "cohere", **ARCHS["cohere"])
    # float32: in bf16 the norms' weight-grad difference is below the step's other roundings
    rest = "tp-invariant-linear,invariant-gemm,invariant-vocab-softmax,invariant-grad-norm"
    s = _compare(path, tmp_path / "r", "--dtype", "float32", "--fix", rest)
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert d["class"] != "bug" and fd["cause"] == "norm-weight-grad", json.dumps(d)[:1500]
    assert fd["module"].endswith(("q_norm", "k_norm")), fd
    assert d["confirmation"]["fix"] == "invariant-norm-grad"
    assert d["confirmation"]["verdict"] == "confirmed" and d["confirmation"]["status_after"] == "bitwise"


def test_cohere_qk_norm_under_transformers_own_plan_fails_at_tp2(tmp_path):
    # negative control: the same checkpoint with transformers' plan written in its config.json (the
    # user's plan wins over tpdiag's table): the whole [heads, head_dim] norm weight meets the rank's
    # half of the heads
    from transformers import AutoConfig

    path = save_bf16("cohere", tmp_path / "cohere", **ARCHS["cohere"])
    cfg = json.loads((tmp_path / "cohere" / "config.json").read_text())
    cfg["base_model_tp_plan"] = dict(AutoConfig.for_model("cohere").base_model_tp_plan)
    (tmp_path / "cohere" / "config.json").write_text(json.dumps(cfg))
    p = run_cli("compare", "--model", "hf:" + path, "--tp", "1,2", "--out", str(tmp_path / "r"), "--format", "json",
                "--no-baseline", "--no-confirm", "--forward-only", "--dtype", "bfloat16")
    s = json.loads(p.stdout)
    assert s["degrees"]["2"]["status"] == "failed", json.dumps(s["degrees"])[:1500]
    assert "must match the size of tensor b" in json.dumps(s["degrees"]["2"])


def test_cohere_rollout_at_tp2_under_the_fixes_is_tp1s_bits(tmp_path):
    path = save_bf16("cohere", tmp_path / "cohere", **ARCHS["cohere"])
    files, _ = engine(path, **SAMPLE)
    s, got = rollout(tmp_path, files["raw"], path, tp=(1, 2), fixes=("none", "all"))
    c = s["configurations"]
    assert all(v["status"] == "ok" for v in c.values()), {k: v.get("reason") for k, v in c.items()}
    for mode in ("decode", "prefill"):
        for a, b in zip(got[f"tp1-mb8-{mode}-all"], got[f"tp2-mb8-{mode}-all"]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), mode  # raw bits (NaN: a prompt's)
    # stock TP=2 is another reduction order: close to the engine, not its bits
    m = c["tp2-mb8-decode-none"]["metrics"]
    assert m["exact_tokens"] < m["tokens"] and m["max_abs"] < 0.05, m
    assert s["closest"]["configurations"] == ["tp1-mb8-decode-none"] and s["closest"]["reproduced"] is True


def test_cohere_norm_grads_across_micro_batches_found_and_fixed(tmp_path):
    # gradient accumulation over 2 micro-batches of 1 vs one of 2: Cohere's LayerNorm (no
    # normalized_shape, float32 formula) was no norm the fix carried, so `--fix all` read
    # batch-variant-kernel at model.norm's weight grad; its replicated norms now carry their grad in
    # fixed token blocks, its per-head q/k norms head by head
    path = save_bf16("cohere", tmp_path / "cohere", **ARCHS["cohere"])
    rest = "tp-invariant-linear,invariant-gemm,invariant-vocab-softmax,invariant-grad-norm,invariant-attention"
    p = run_cli("compare", "--model", "hf:" + path, "--tp", "1", "--micro-batch", "2,1", "--out", str(tmp_path / "r"),
                "--format", "json", "--no-baseline", "--dtype", "bfloat16", "--fix", rest)
    assert p.returncode == 0, p.stderr[-2000:]
    c = json.loads(p.stdout)["configurations"]["1-mb1"]
    fd = c["first_divergence"]
    assert fd["cause"] == "batch-variant-kernel" and fd["kind"] == "param_grad" and "norm" in fd["module"], fd
    assert c["confirmation"]["fix"] == "invariant-norm-grad", c["confirmation"]
    assert c["confirmation"]["verdict"] == "confirmed" and c["confirmation"]["status_after"] == "bitwise"


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_an_eager_attention_engine_is_reproduced_with_attention_eager(tmp_path, kind, monkeypatch):
    # the trainer and engine load with from_pretrained(..., attn_implementation="eager"): Granite's
    # attention_multiplier is eager's scaling, Cohere's q/k norms feed it
    from transformers import AutoModelForCausalLM

    path = save_bf16(kind, tmp_path / kind, **ARCHS[kind])
    load = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: load(*a, attn_implementation="eager", **k))
    files, model = engine(path, **SAMPLE)
    assert model.config._attn_implementation == "eager"
    s, _ = rollout(tmp_path, files["raw"], path, modes=("decode",), attention=("eager", "auto"))
    c = s["configurations"]
    n = sum(len(x["logprobs"]) for x in files["raw"])
    assert c["tp1-mb8-decode-none-eager"]["metrics"]["exact_tokens"] == n
    # negative control: the model's own (SDPA) attention is another kernel
    assert c["tp1-mb8-decode-none"]["metrics"]["exact_tokens"] < n


def test_phi_qk_layernorm_under_transformers_plan_is_a_bug_and_the_right_plan_is_rounding(tmp_path):
    # Phi with qk_layernorm: a LayerNorm over head_dim applied to the rank's local heads; transformers'
    # plan has no entry for it, so each rank's weight/bias grad sums its own heads only and the
    # replicas part - a real bug of that plan (the user's tp_plan="auto" run has it), named as one.
    # The plan with its grads all-reduced (written in config.json, as a user would) is rounding only
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path / "phi"
    cfg = AutoConfig.for_model("phi", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                               max_position_embeddings=256, qk_layernorm=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    s = _compare(str(d), tmp_path / "stock", "--no-confirm")
    deg = s["degrees"]["2"]
    assert deg["class"] == "bug", json.dumps(deg)[:1500]
    bad = {(f["module"].rsplit(".", 1)[-1], f["cause"]) for f in deg["findings"]}
    assert ("q_layernorm", "rank-inconsistent-replica") in bad and ("k_layernorm", "rank-inconsistent-replica") in bad
    raw = json.loads((d / "config.json").read_text())
    raw["base_model_tp_plan"] = {**cfg.base_model_tp_plan,
                                 "layers.*.self_attn.q_layernorm": "replicated_with_grad_allreduce",
                                 "layers.*.self_attn.k_layernorm": "replicated_with_grad_allreduce"}
    (d / "config.json").write_text(json.dumps(raw))
    # under --fix all (which refused that plan's LayerNorms before, failing the reference world): the
    # norms are left stock, their grads all-reduced, and what remains is their weight grads' order
    s = _compare(str(d), tmp_path / "right", "--no-confirm", "--fix", "all")
    deg = s["degrees"]["2"]
    assert deg["class"] != "bug" and not [f for f in deg.get("findings", []) if f["cause"] in
                                          ("rank-inconsistent-replica", "sharding-bug")], json.dumps(deg)[:1500]
    fd = deg["first_divergence"]
    assert fd["cause"] == "norm-weight-grad" and fd["module"].endswith("layernorm"), fd
