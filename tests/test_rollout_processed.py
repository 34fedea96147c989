"""The engine's logprobs computed another common way, from generate()'s own outputs: tpdiag says what
they are instead of 'no sign of processing'. On 85fe6da a temperature outside 0.5..2 (T=3) and a
temperature followed by top-p (generate()'s output_scores at T=0.7, top_p=0.9) both read 'no sign of
processing', and a rollout with a few tokens replaced read 'processed'. Negative controls: a bf16
engine against a float32 trainer (precision noise) and the engine's raw logits fit no processing."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.test_rollout_generate_zoo import _write  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _write("llama", tmp_path_factory.mktemp("proc") / "llama", rope_theta=500000.0)


def _engine(path, dtype="float32", scores=False, divide=1.0, **sample):
    """One generate() call over 4 left-padded prompts, 8 tokens each; each chosen token's logprob
    from log_softmax(output_logits / divide), or from output_scores (what the sampler drew from)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    m.generation_config.eos_token_id = None  # no EOS: no min-length processor in the scores
    g = torch.Generator().manual_seed(1)
    lens, P = (5, 8, 6, 7), 8
    ids = torch.zeros(4, P, dtype=torch.long)
    mask = torch.zeros(4, P, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, P - n:] = torch.randint(3, 128, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(1)
    res = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                     output_logits=True, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                     **{"top_k": 0, "top_p": 1.0, "temperature": 1.0, **sample})
    steps = res.scores if scores else res.logits
    return [{"input_ids": res.sequences[r, P - n:].tolist(), "prompt_len": n,
             "logprobs": [float(torch.log_softmax(s[r].float() / divide, -1)[res.sequences[r, P + j]])
                          for j, s in enumerate(steps)]} for r, n in enumerate(lens)]


def _processed(tmp_path, rows, model):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return run_rollout(RolloutConfig(file=str(f), model="hf:" + model, micro_batch=(4,), modes=("decode",),
                                     fixes=("none",)))["processed"]


def test_temperature_outside_half_to_two_is_named(tmp_path, model):
    pr = _processed(tmp_path, _engine(model, temperature=3.0, divide=3.0), model)
    assert pr["detected"] is True and pr["kind"] == "temperature" and pr["temperature_fit"] == 3.0


def test_temperature_then_top_p_from_generate_scores_is_named(tmp_path, model):
    pr = _processed(tmp_path, _engine(model, scores=True, temperature=0.7, top_p=0.9), model)
    assert pr["detected"] is True and pr["kind"] == "temperature+filter" and pr["temperature_fit"] == 0.7
    assert "temperature 0.7" in pr["explanation"]


def test_noise_and_replaced_tokens_are_not_called_processing(tmp_path, model):
    # raw logits at T=0.7: the engine's numbers are the trainer's
    pr = _processed(tmp_path, _engine(model, temperature=0.7), model)
    assert pr["detected"] is False
    # a bf16 engine against the float32 trainer: differences both ways, no temperature or filter
    pr = _processed(tmp_path, _engine(model, "bfloat16"), model)
    assert pr["detected"] is False and pr["kind"] is None, pr
    # the last token of every sequence replaced (the logprob is another token's): not a filter
    rows = _engine(model)
    for x in rows:
        x["input_ids"][-1] = (x["input_ids"][-1] + 7) % 128
    pr = _processed(tmp_path, rows, model)
    assert pr["detected"] is False, pr
