"""`tpdiag rollout` of an hf: checkpoint saved in bf16, without --dtype bfloat16 (the default is
float32): an engine that loads the checkpoint as saved computes in bf16, nothing reproduces it,
and the closest line could only say 'another dtype'. A note now names both dtypes and the option.
Found as a new user (a tiny Llama saved with save_pretrained in bf16, generate() as the engine)."""
import json

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    d = tmp_path_factory.mktemp("ckpt")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(d / "model"))
    f = d / "rollout.jsonl"
    f.write_text(json.dumps({"input_ids": [3, 9, 27, 17, 51], "prompt_len": 3, "logprobs": [-4.1, -4.2]}) + "\n")
    return str(d / "model"), str(f)


def _notes(ckpt, dtype):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    model, f = ckpt
    s = run_rollout(RolloutConfig(file=f, model="hf:" + model, micro_batch=(1,), modes=("prefill",),
                                  fixes=("none",), dtype=dtype, top=0))
    assert s["dtype"] == dtype
    return [n for n in s["notes"] if n.startswith("the checkpoint is saved in")]


def test_a_bf16_checkpoint_run_in_float32_is_named(ckpt):
    from tpdiag.models.dtypes import saved_dtype

    assert saved_dtype(ckpt[0]) == "bfloat16"  # what save_pretrained wrote, read back
    assert _notes(ckpt, "float32") == [
        "the checkpoint is saved in bfloat16 (its config.json) and the trainer ran float32 (--dtype): an "
        "engine that loads it as saved computes in bfloat16 - add --dtype bfloat16 to try that"]
    assert _notes(ckpt, "bfloat16") == []  # control: the matching dtype says nothing


def test_saved_dtype_reads_both_spellings(tmp_path):
    from tpdiag.models.dtypes import saved_dtype

    for body, want in [({"torch_dtype": "float32"}, "float32"), ({"dtype": "torch.float16"}, "float16"),
                       ({"dtype": "auto"}, None), ({}, None), ([1], None)]:
        (tmp_path / "config.json").write_text(json.dumps(body))
        assert saved_dtype(str(tmp_path)) == want, body
    assert saved_dtype(str(tmp_path / "missing")) is None
