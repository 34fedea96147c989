"""A model directory whose generation config turns the KV cache off.

transformers' generate() reads `use_cache` from the directory's generation_config.json (made from
config.json where there is none). Off, every new token recomputes the whole left-padded batch from
the first position - other GEMM shapes than a KV cache's one-token calls, so other bits - and no
configuration tpdiag runs does that (`--mode decode` runs through a KV cache, `--mode prefill` one
right-padded call). A new user's tiny model (examples/make_tiny_hf.py writes `use_cache: false`)
sampled with generate() was reproduced 0 of 4 sequences and the report blamed the engine's own
kernels; the same generate() with use_cache=True is `tp1-mb4-decode-none` bit for bit.
"""
from __future__ import annotations

import json
import os


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def cache_off(model_dir: str) -> str | None:
    """The file that turns generate()'s KV cache off in an hf: directory, or None: its
    generation_config.json where it has one (absent key: transformers' default, on), else
    config.json (the generation config is made from it)."""
    gen = _read(os.path.join(model_dir, "generation_config.json"))
    if gen is not None:
        return "generation_config.json" if gen.get("use_cache") is False else None
    cfg = _read(os.path.join(model_dir, "config.json")) or {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return "config.json" if cfg.get("use_cache", text.get("use_cache")) is False else None


def note(spec: str) -> str | None:
    """The note for an hf: model whose generate() runs without a KV cache, or None."""
    from tpdiag.models.spec import parse_spec

    s = parse_spec(spec)
    if s.kind != "hf":
        return None
    where = cache_off(s.value)
    if where is None:
        return None
    return (f"the model directory's {where} has use_cache false: generate() with it runs without a KV "
            "cache, recomputing the whole batch at every new token, which no configuration here does "
            "(--mode decode runs through a KV cache) - if the engine was that generate(), sample again "
            "with generate(..., use_cache=True) (or set use_cache true in generation_config.json) and "
            "write the file again: then --mode decode is what it computed")
