"""Write tiny Hugging Face model directories (config.json only) for `tpdiag compare --model hf:DIR`.

    python examples/make_tiny_hf.py llama /tmp/tiny-llama-hf
    python examples/make_tiny_hf.py qwen3 /tmp/tiny-qwen3-hf
    tpdiag compare --model hf:/tmp/tiny-llama-hf --tp 1,2,4,8

No weights are written: tpdiag then initialises the whole model from its seed on every rank
(identical weights at every degree) before transformers' TP plan shards it.
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


def write_tiny(kind: str, out_dir: str, **overrides) -> str:
    """Write `out_dir/config.json` for a tiny `kind` model; returns out_dir."""
    if kind not in CONFIGS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(CONFIGS)}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**CONFIGS[kind], **overrides}, f, indent=2)
        f.write("\n")
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(CONFIGS))
    ap.add_argument("out_dir")
    args = ap.parse_args()
    write_tiny(args.kind, args.out_dir)
    print(f"wrote {os.path.join(args.out_dir, 'config.json')}; run: "
          f"tpdiag compare --model hf:{args.out_dir} --tp 1,2,4,8")


if __name__ == "__main__":
    main()
