"""--fix all on transformers models: bitwise across TP; the per-head q/k norm's weight grad is
found as norm-weight-grad and fixed by invariant-norm-grad (negative control)."""
import json

import pytest

from conftest import run_cli
from hf_configs import write_tiny

pytest.importorskip("transformers", minversion="5")


def compare(tmp_path, model_dir, *args):
    p = run_cli("compare", "--model", model_dir, "--out", str(tmp_path / "r"), "--format", "json",
                "--no-baseline", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_hf_llama_fix_all_bitwise_bf16(tmp_path):
    s = compare(tmp_path, write_tiny("llama", tmp_path / "llama"), "--tp", "1,2,4", "--dtype", "bfloat16",
                "--fix", "all", "--no-confirm")
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]


def test_hf_qwen3_qk_norm_grad_found_and_fixed(tmp_path):
    rest = "tp-invariant-linear,invariant-gemm,invariant-vocab-softmax,invariant-grad-norm"
    s = compare(tmp_path, write_tiny("qwen3", tmp_path / "qwen3"), "--tp", "1,2", "--fix", rest)
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["cause"] == "norm-weight-grad" and fd["module"].endswith(("q_norm", "k_norm")), fd
    assert d["confirmation"]["fix"] == "invariant-norm-grad"
    assert d["confirmation"]["verdict"] == "confirmed" and d["confirmation"]["status_after"] == "bitwise"


def test_hf_olmo2_row_parallel_that_splits_its_input_is_bitwise_under_fix_all(tmp_path):
    # OLMo2's plan gathers q/k/v's columns (its q_norm/k_norm read every head) and its o_proj is
    # rowwise_split_input: the row-parallel style takes the whole input and splits it itself. The
    # tp-invariant-linear wrapper fed the whole input to the rank's weight shard (TP=2: "mat1 and
    # mat2 shapes cannot be multiplied (16x64 and 32x64)", the degree failed)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmo2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                               max_position_embeddings=64, tie_word_embeddings=False)
    assert cfg.base_model_tp_plan["layers.*.self_attn.o_proj"] == "rowwise_split_input"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "olmo2")
    s = compare(tmp_path, f"hf:{tmp_path / 'olmo2'}", "--tp", "1,2", "--fix", "all", "--no-confirm")
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]


def test_hf_gemma3_norms_left_stock_keep_their_grad_all_reduce(tmp_path):
    # Gemma3's q_norm/k_norm (x * (1 + w)) are not the invariant kernel's formula, so
    # invariant-norm-grad leaves them stock; their weight grads must still be all-reduced as
    # transformers' replicated_with_grad_allreduce does. The fix switched that all-reduce off for
    # every per-head norm, and --fix all read "BUG ... self_attn.k_norm (param_grad weight)
    # rank-inconsistent-replica" (each rank kept its own heads' share)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=64,
                               max_position_embeddings=64, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"])
    assert cfg.base_model_tp_plan["layers.*.self_attn.k_norm"] == "replicated_with_grad_allreduce"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gemma3")
    s = compare(tmp_path, f"hf:{tmp_path / 'gemma3'}", "--tp", "1,2", "--fix", "all", "--no-confirm")
    assert s["status"] in ("bitwise", "divergent"), s["status"]
    d = s["degrees"]["2"]
    assert d["class"] != "bug" and d["first_divergence"]["cause"] != "rank-inconsistent-replica", json.dumps(d)[:1500]
