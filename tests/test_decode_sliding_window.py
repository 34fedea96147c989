"""A sliding-window model (Mistral, window 4 < the sequence) in compare's decode at TP=2: its decode
calls' attention mask is [B, 1, 1, window] where the prompt call's is [B, 1, P, P] - the calls'
positions along dim 2 but another key length. Merging the calls' records cat them along the
positions and the world failed ("Sizes of tensors must match except in dimension 2. Expected size 8
but got size 4"); now they are each call's own records and the world runs. Under hash capture the
calls' hash lanes were added up as slices of the reference's mask, and the first divergence read
"forward: model (in 1)" (the mask, unknown) instead of the attention's own records."""
import json

import pytest

from tests.conftest import run_cli

pytest.importorskip("transformers")


@pytest.mark.parametrize("capture", ["full", "hash"])
def test_sliding_window_decode_world_runs(tmp_path, capture):
    from transformers import AutoConfig

    AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                         max_position_embeddings=64, sliding_window=4, tie_word_embeddings=False
                         ).save_pretrained(tmp_path / "m")
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"hf:{tmp_path / 'm'}", "--tp", "2", "--mode", "prefill,decode",
                "--forward-only", "--no-baseline", "--no-confirm", "--no-judge-downstream", "--out", str(out),
                "--capture", capture, "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads((out / "summary.json").read_text())
    entry = s["configurations"]["2-decode"]
    assert entry["status"] in ("bitwise", "divergent"), entry
    fd = entry["first_divergence"]
    assert fd["phase"] == "forward" and fd["module"].startswith("model.layers.0.self_attn"), fd


def test_sliding_window_decode_under_every_fix_is_judged(tmp_path):
    """Under `--fix all` both decode configurations read `unknown` at the KV cache's cat: the float64
    re-execution of the attention module raised inside invariant-attention (float64 q/k/v refused),
    so nothing judged the attention's output, and at TP=2 decode (a grid configuration, tp+mode)
    no axis rule applied. The oracle now runs the stock attention in float64 (fixes/attention.py
    exact_attention), and a grid configuration whose TP alone is bitwise is named along its other
    axis: both read batch-variant-kernel, rounding (the decode attention over the window's cache)."""
    from transformers import AutoConfig

    AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                         max_position_embeddings=64, sliding_window=4, tie_word_embeddings=False
                         ).save_pretrained(tmp_path / "m")
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"hf:{tmp_path / 'm'}", "--tp", "1,2", "--mode", "prefill,decode", "--grid",
                "--fix", "all", "--forward-only", "--no-baseline", "--out", str(out))
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["degrees"]["2"]["status"] == "bitwise", s["degrees"]["2"]
    for label in ("1-decode", "2-decode"):
        fd = s["configurations"][label]["first_divergence"]
        assert fd["module"] == "model.layers.0.self_attn" and fd["cause"] == "batch-variant-kernel", (label, fd)
        assert s["configurations"][label]["class"] == "rounding", s["configurations"][label]
    assert s["class"] == "rounding" and "unknown" not in p.stdout, p.stdout
    notes = json.loads((out / "ops" / "tp1" / "world.json").read_text()).get("oracle_notes") or {}
    assert not any("invariant-attention" in n.get("why", "") for n in notes.values()), notes
