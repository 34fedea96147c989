"""Tiny Hugging Face model directories for tests: the same configs as examples/make_tiny_hf.py."""
import importlib.util
import os

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "make_tiny_hf.py")
_spec = importlib.util.spec_from_file_location("tpdiag_example_make_tiny_hf", _EXAMPLE)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

CONFIGS = _mod.CONFIGS


def write_tiny(kind: str, out_dir, **overrides) -> str:
    """Write out_dir/config.json for a tiny `llama` or `qwen3`; returns the `hf:DIR` spec."""
    return "hf:" + _mod.write_tiny(kind, str(out_dir), **overrides)
