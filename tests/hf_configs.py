"""Tiny Hugging Face model directories for tests: the same configs as examples/make_tiny_hf.py."""
import importlib.util
import os

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "make_tiny_hf.py")
_spec = importlib.util.spec_from_file_location("tpdiag_example_make_tiny_hf", _EXAMPLE)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

CONFIGS = _mod.CONFIGS
write_weights = _mod.write_weights  # random weights for a written config, save_pretrained


def write_tiny(kind: str, out_dir, **overrides) -> str:
    """Write out_dir/config.json for a tiny `llama` or `qwen3`; returns the `hf:DIR` spec."""
    return "hf:" + _mod.write_tiny(kind, str(out_dir), **overrides)


def save_tiny_bf16_llama(out_dir) -> str:
    """A tiny Llama (vocab 64, hidden 32, one layer, GQA 2/1) built from seed 0 and saved in bf16
    with save_pretrained, as a user saves a checkpoint; returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out_dir))
    return str(out_dir)
