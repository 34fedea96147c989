"""Write tiny Hugging Face model directories (config.json only) for `tpdiag compare --model hf:DIR`.

    python examples/make_tiny_hf.py llama /tmp/tiny-llama-hf
    python examples/make_tiny_hf.py qwen3 /tmp/tiny-qwen3-hf
    tpdiag compare --model hf:/tmp/tiny-llama-hf --tp 1,2,4,8

No weights are written unless `--weights`: tpdiag then initialises the model from its seed on
every rank (identical weights at every degree). `--weights` also writes random weights as
`*.safetensors` (transformers' own init, built on the GPU when there is one), for timing the
checkpoint-loading path at a real size (docs/scale.md).
"""
from __future__ import annotations

import argparse
import json
import os

# Sized like tpdiag's built-in tiny-llama: 16 heads / 8 kv heads of head_dim 16, so every
# degree up to 8 divides the heads, and every column shard stays >= 16 wide (on x86 CPU BLAS
# a narrower GEMM takes another kernel path, a divergence that is real but not the point here).
_COMMON = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_cache": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "rope_theta": 10000.0,
    "dtype": "float32",
}

CONFIGS = {
    "llama": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False},
    # Qwen3 adds per-head RMSNorms (q_norm/k_norm) between the column-parallel q/k projections
    # and attention: unplanned modules whose outputs are head shards with no layout marker.
    "qwen3": {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False},
}

# MoE: 4 experts, top-2, expert width 64 (16 per rank at TP=4), 4 query/kv heads of 16.
_MOE = {**_COMMON, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 128, "num_experts_per_tok": 2}
CONFIGS.update({
    "qwen3_moe": {**_MOE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "rms_norm_eps": 1e-6, "num_experts": 4, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1, "norm_topk_prob": True, "use_sliding_window": False},
    "mixtral": {**_MOE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "rms_norm_eps": 1e-5, "num_local_experts": 4, "intermediate_size": 64},
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with a shared expert; MLA attention
    # is unplanned (replicated) in transformers' plan
    "deepseek_v3": {**_MOE, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "rms_norm_eps": 1e-6, "n_routed_experts": 4, "n_shared_experts": 1,
                    "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,
                    "rope_interleave": True},
    # transformers' plan splits only the embedding: tpdiag's own (tpdiag/models/plans_hf.py) is used
    "gpt_oss": {**_MOE, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "rms_norm_eps": 1e-5, "num_local_experts": 4, "intermediate_size": 64,
                "experts_per_token": 2, "sliding_window": 16, "layer_types":
                ["sliding_attention", "full_attention"], "attention_bias": True},
})



# Real sizes (config only, random weights): `--shape qwen3-4b` with kind qwen3 is shaped like
# Qwen3-4B (hidden 2560, 36 layers, 32/8 heads of 128, ffn 9728, vocab 151936, tied head), for
# timing a world's start and step at a real size on GPUs (docs/scale.md).
SHAPES = {
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                 "tie_word_embeddings": True, "dtype": "bfloat16"},
    # Llama-3.1-8B / -70B shapes (with kind llama): GQA 32/8 and 64/8 heads of 128, vocab 128256,
    # untied head; a 70B does not fit TP=1 on one GPU: `tpdiag compare --layers N` (docs/scale-70b.md)
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                 "tie_word_embeddings": False, "dtype": "bfloat16"},
    "llama-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                  "tie_word_embeddings": False, "dtype": "bfloat16"},
}


def write_tiny(kind: str, out_dir: str, **overrides) -> str:
    """Write `out_dir/config.json` for a tiny `kind` model; returns out_dir."""
    if kind not in CONFIGS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(CONFIGS)}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**CONFIGS[kind], **overrides}, f, indent=2)
        f.write("\n")
    return out_dir


def write_weights(out_dir: str) -> None:
    """Random weights for out_dir's config, saved with `save_pretrained` as safetensors shards."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(out_dir)
    # Built directly on the GPU when there is one: a 4B model's CPU init takes minutes.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(cfg, "dtype", None) or torch.float32)
    # generate() reads use_cache from the generation config, which save_pretrained makes from
    # config.json's `use_cache: false`: generate() would then recompute the whole batch at every
    # token, which no engine and no `tpdiag rollout --mode decode` does (docs/rl.md). The cache on
    # for generate() only: tpdiag turns it off for its own training step whatever the file says.
    model.generation_config.use_cache = True
    model.save_pretrained(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(CONFIGS))
    ap.add_argument("out_dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a real model's sizes instead of tiny ones")
    ap.add_argument("--weights", action="store_true", help="also write random weights (*.safetensors)")
    args = ap.parse_args()
    write_tiny(args.kind, args.out_dir, **(SHAPES[args.shape] if args.shape else {}))
    if args.weights:
        write_weights(args.out_dir)
        # save_pretrained rewrote config.json in its own form: keep ours, the config-only run's
        write_tiny(args.kind, args.out_dir, **(SHAPES[args.shape] if args.shape else {}))
    print(f"wrote {os.path.join(args.out_dir, 'config.json')}; run: "
          f"tpdiag compare --model hf:{args.out_dir} --tp 1,2,4,8")


if __name__ == "__main__":
    main()
