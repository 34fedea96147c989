"""`--attention eager` alone: a trainer that loads its model with attn_implementation="eager" runs
eager attention at every degree, and compare runs it so - every configuration eager, TP=1's logits
transformers' own eager model's bit for bit (and not its SDPA model's: the switch is real). It was
refused with the reason for eager beside SDPA (other layer inputs), which does not hold when every
configuration is eager; eager beside another value, and eager for a model with no switch, are still
refused in one line (tests/test_configs.py)."""
import pytest
import torch

from tests.conftest import run_cli

pytest.importorskip("transformers")


def test_eager_alone_runs_every_configuration_eager(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpdiag.records.store import RecordSet

    path = str(tmp_path / "m")
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(torch.bfloat16).save_pretrained(path)
    out = tmp_path / "run"
    p = run_cli("compare", "--model", "hf:" + path, "--tp", "1,2", "--attention", "eager", "--dtype", "bfloat16",
                "--forward-only", "--no-baseline", "--no-confirm", "--no-judge-downstream", "--out", str(out))
    assert p.returncode == 0, p.stderr + p.stdout
    assert "SDPA backend that ran: none (no SDPA call) in every configuration" in " ".join(p.stdout.split())
    rs = RecordSet(str(out / "tp1"))
    ids = next(rs.tensor(e) for e in rs.events if e["kind"] == "batch" and e["name"] == "input_ids")
    logits = rs.tensor(next(e for e in rs.events if e["kind"] == "logits"))
    torch.set_num_threads(1)  # as the worlds' ranks
    got = {}
    for impl in ("eager", "sdpa"):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=impl)
        with torch.no_grad():
            got[impl] = m(ids).logits
    assert torch.equal(logits, got["eager"])
    assert not torch.equal(logits, got["sdpa"])  # the two differ here: the equality above is eager's
