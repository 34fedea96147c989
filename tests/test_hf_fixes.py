"""--fix all on transformers models: bitwise across TP; the per-head q/k norm's weight grad is
found as norm-weight-grad and fixed by invariant-norm-grad (negative control)."""
import json

import pytest
import torch

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


def test_hf_gemma3_per_head_norms_are_bitwise_under_fix_all(tmp_path):
    # Gemma3's q_norm/k_norm compute x * (1 + w), not the w * rms(x) of the invariant kernel. First
    # the fix replaced them (another model); then it left them stock, and it switched their
    # weight-grad all-reduce off (--fix all read "BUG ... self_attn.k_norm (param_grad weight)
    # rank-inconsistent-replica"); then, stock with the all-reduce, --fix all read divergent,
    # rounding, norm-weight-grad at k_norm's weight grad (each rank's heads summed, then added
    # across ranks: another order than TP=1's). Now the (1 + w) formula has a kernel of its own
    # (kernels/norm_grad.OffsetRMSNormSP): its weight grad by fixed head groups and one tree
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=64,
                               max_position_embeddings=64, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"])
    assert cfg.base_model_tp_plan["layers.*.self_attn.k_norm"] == "replicated_with_grad_allreduce"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gemma3")
    s = compare(tmp_path, f"hf:{tmp_path / 'gemma3'}", "--tp", "1,2", "--fix", "all", "--no-confirm")
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]


def test_offset_rmsnorm_kernel_is_the_modules_forward_bit_for_bit():
    # the kernel must compute the model's own norm (the same logprobs as the stock model), at any
    # head grouping, in float32 and bf16; and its grads are the stock formula's to rounding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from tpdiag.kernels.norm_grad import OffsetRMSNormSP

    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        norm = Gemma3RMSNorm(16, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16, generator=g).to(dtype))
        x = torch.randn(2, 5, 4, 16, generator=g).to(dtype).requires_grad_()
        want = norm(x)
        gy = torch.randn(want.shape, generator=g).to(dtype)
        want.backward(gy)
        for groups in (1, 2, 4):
            xk = x.detach().clone().requires_grad_()
            w = norm.weight.detach().clone().requires_grad_()
            y = OffsetRMSNormSP.apply(xk, w, 1e-6, groups, -2)
            assert torch.equal(y, want), (dtype, groups)
            y.backward(gy)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(w.grad, norm.weight.grad, **tol)
            torch.testing.assert_close(xk.grad, x.grad, **tol)
    # control: the plain kernel (w * rms(x)) is not this module's forward
    from tpdiag.kernels.norm_grad import RMSNormSP

    assert not torch.equal(RMSNormSP.apply(x.detach(), norm.weight.detach(), 1e-6, 1, -2), norm(x).detach())


def test_per_head_norms_with_fewer_heads_than_tree_groups_are_bitwise(tmp_path):
    # G = 8 tree groups (a TP=1 rollout's default, or --tree-groups 8) on a Qwen3 with 4 query and 2
    # KV heads: the per-head norms' weight grads were cut into G groups of heads, and the run failed
    # 'model.layers.0.self_attn.q_norm (heads): reduced dimension 4 is not divisible by 8 groups'
    # (`tpdiag rollout`'s default --fix none,all lost its 'all' configurations). They are cut into
    # gcd(heads, G) groups now, the same at every degree
    model = write_tiny("qwen3", tmp_path / "qwen3", num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                       intermediate_size=128, vocab_size=128)
    s = compare(tmp_path, model, "--tp", "1,2", "--tree-groups", "8", "--fix", "all", "--no-confirm")
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]


def test_hf_deepseek_v2_mla_rope_grad_is_named_for_what_it_sums(tmp_path):
    # MLA: kv_a_proj_with_mqa is replicated; its output's rope columns feed k_rot, expanded over the
    # heads TP shards, and the mla_kv_a_proj style all-reduces each rank's sum over its own heads in
    # the backward. Under --fix all TP=2 differs from TP=1 at kv_a_proj's weight grad, by rounding.
    # It read `shape-dependent-gemm` ("every input it consumed was bitwise equal"), whose fix
    # (invariant-gemm) was already on - a replicated Linear runs the same GEMM at every degree. The
    # difference is the heads' sum split across ranks: a dgrad summed over sharded columns
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("deepseek_v2", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                               max_position_embeddings=64, q_lora_rank=None, kv_lora_rank=32,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "dsv2")
    s = compare(tmp_path, f"hf:{tmp_path / 'dsv2'}", "--tp", "1,2", "--dtype", "bfloat16", "--fix", "all",
                "--no-confirm", "--batch-size", "1", "--seq-len", "8")
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["module"].endswith("self_attn.kv_a_proj_with_mqa") and fd["kind"] == "param_grad", fd
    assert fd["cause"] == "column-parallel-dgrad" and not fd["oracle"]["far"], fd
    assert "each rank's share of a sum over the heads" in fd["detail"] and d["findings"] == [], fd
    # --no-confirm under --fix all: the cause's fix was on, so `--fix auto` has nothing to add (it
    # read "then `tpdiag compare --fix auto` applies the fixes that remove it")
    assert "tp-invariant-linear) was already on" in s["what_to_do"], s["what_to_do"]
