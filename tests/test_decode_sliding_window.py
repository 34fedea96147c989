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
