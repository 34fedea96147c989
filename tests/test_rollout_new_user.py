"""What a new user's mistakes read as in `tpdiag rollout` (found following README and docs/rl.md with
a tiny Llama saved by save_pretrained in bf16 and generate() as the engine):

- the bf16 checkpoint run without --dtype bfloat16 (the default is float32): nothing reproduces
  the engine and the closest line could only say 'another dtype'; a note now names both dtypes;
- the wrong --model (tiny-llama, vocabulary 512, for the engine's 64): every logprob lower, read
  as 'renormalised after top-k/top-p filtering' alone; the line now names another model too."""
import json

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch
    from hf_configs import save_tiny_bf16_llama
    from transformers import LlamaForCausalLM

    d = tmp_path_factory.mktemp("ckpt")
    save_tiny_bf16_llama(d / "model")
    # the engine's own logprobs of its tokens (a forward of the checkpoint, float32 log-softmax)
    m = LlamaForCausalLM.from_pretrained(str(d / "model"), dtype=torch.bfloat16)
    seqs = [[3, 9, 27, 17, 51, 8, 30], [5, 6, 40, 2, 33, 12, 60]]
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor(seqs)).logits.float(), -1)
    f = d / "rollout.jsonl"
    f.write_text("".join(json.dumps({"input_ids": s, "prompt_len": 3,
                                     "logprobs": [lp[b, j - 1, s[j]].item() for j in range(3, len(s))]}) + "\n"
                         for b, s in enumerate(seqs)))
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
        "the checkpoint is saved in bfloat16 (its config.json) and this run computes in float32 (--dtype): "
        "`from_pretrained(DIR)` loads it in bfloat16 (transformers >= 5 loads as saved; `dtype=torch.float32` "
        "loads float32), as an engine does - add --dtype bfloat16 to run the model as it is loaded"]
    assert _notes(ckpt, "bfloat16") == []  # control: the matching dtype says nothing


def test_saved_dtype_reads_both_spellings(tmp_path):
    from tpdiag.models.dtypes import saved_dtype

    for body, want in [({"torch_dtype": "float32"}, "float32"), ({"dtype": "torch.float16"}, "float16"),
                       ({"dtype": "auto"}, None), ({}, None), ([1], None)]:
        (tmp_path / "config.json").write_text(json.dumps(body))
        assert saved_dtype(str(tmp_path)) == want, body
    assert saved_dtype(str(tmp_path / "missing")) is None


def test_another_model_is_named_beside_processing(ckpt):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    s = run_rollout(RolloutConfig(file=ckpt[1], model="tiny-llama", micro_batch=(2,), modes=("prefill",),
                                  fixes=("none",), top=0))
    assert s["metrics"]["mean_diff"] > 1.0  # log(512 / 64) nats: each engine logprob is higher
    assert s["processed"]["kind"] == "systematic"
    assert "or of another model than --model" in s["processed"]["explanation"]
