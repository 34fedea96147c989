"""An RL team's run against transformers' own numbers, for architectures the other rollout tests do
not cover (OLMo2, Gemma3 with sliding and full layers, Qwen2-MoE with a shared expert): a tiny
checkpoint saved in bf16 with save_pretrained, loaded as the trainer loads it
(`AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16)`), one generate() call over
left-padded prompts of different lengths with an RL team's sampling settings (temperature, top_k,
top_p, min_p, repetition_penalty, an EOS, num_return_sequences=2).

- The rollout's raw logprobs (generate()'s output_logits) are tpdiag's decode at the engine's batch
  bit for bit, and the trainer's logprobs (tpdiag's prefill) are a plain forward of from_pretrained's
  model bit for bit.
- The rollout's processed logprobs (generate()'s output_scores, what the sampler drew from) are
  reproduced bit for bit with --sampling giving the same settings; without it, nothing reproduces.
"""
import pytest
import torch

pytest.importorskip("transformers")

from tests.rl_team import SAMPLE, engine, picked, rollout, save_bf16, trainer_logits  # noqa: E402

ARCHS = {"olmo2": {},
         "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
         "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1)}


@pytest.mark.parametrize("kind", list(ARCHS))
def test_rl_teams_rollout_and_trainer_are_transformers_bits(tmp_path, kind):
    path = save_bf16(kind, tmp_path / kind, **ARCHS[kind])
    files, model = engine(path, **SAMPLE)
    rows = files["raw"]
    assert len(rows) == 8 and len({len(x["input_ids"]) for x in rows}) > 1
    # the rollout: generate()'s raw logprobs are tpdiag's decode at the engine's batch
    s, got = rollout(tmp_path, rows, path, micro_batch=(8, 1))
    m = s["configurations"]["tp1-mb8-decode-none"]["metrics"]
    assert m["exact_tokens"] == m["tokens"] == sum(len(x["logprobs"]) for x in rows)
    assert s["closest"]["reproduced"] is True and s["processed"]["detected"] is False
    # the engine's batch is rounding away from its sequences decoded alone: no batch note
    assert s["batch_leak"] is None, s["batch_leak"]
    # the trainer: tpdiag's prefill of the batch is the user's own forward of from_pretrained's model
    # (right-padded, attention mask), log_softmax of the float32 logits, bit for bit
    lsm = trainer_logits(model, rows).float().log_softmax(-1)
    for i, x in enumerate(rows):
        assert torch.equal(picked(lsm, i, x), got["tp1-mb8-prefill-none"][i]), (kind, i)
        # micro-batch 1: one sequence per forward, as a trainer with micro-batch 1 runs it
        with torch.no_grad():
            one = model(torch.tensor([x["input_ids"]])).logits[0, :-1].float().log_softmax(-1)
        assert torch.equal(one.gather(-1, torch.tensor(x["input_ids"][1:])[:, None])[:, 0],
                           got["tp1-mb1-prefill-none"][i]), (kind, i)
    # the prefill is not the engine: the comparison can fail (its negative control)
    assert s["configurations"]["tp1-mb8-prefill-none"]["metrics"]["exact_tokens"] < m["tokens"]


@pytest.mark.parametrize("kind", list(ARCHS))
def test_generates_processed_scores_are_reproduced_with_its_sampling_settings(tmp_path, kind):
    path = save_bf16(kind, tmp_path / kind, **ARCHS[kind])
    files, _ = engine(path, **SAMPLE)
    rows = files["scores"]
    n = sum(len(x["logprobs"]) for x in rows)
    s, _ = rollout(tmp_path, rows, path, sampling=tuple(SAMPLE.items()))
    m = s["metrics"]
    assert m["exact_tokens"] == m["tokens"] == n, m
    assert s["closest"]["reproduced"] is True and s["closest"]["configurations"] == ["tp1-mb8-decode-none"]
    # the prefill is compared too: over the tokens its filters keep (a sampled token its logits put
    # past a filter's edge is counted, not compared)
    p = s["configurations"]["tp1-mb8-prefill-none"]
    assert p["status"] == "ok" and p["metrics"]["exact_tokens"] < p["metrics"]["tokens"]
    assert p["metrics"]["tokens"] + p["metrics"].get("filtered_out", {}).get("tokens", 0) == n
    assert s["sampling"]["processors"] == ("repetition_penalty=1.1, temperature=0.8, top_k=40, top_p=0.95, "
                                           "min_p=0.02")
    # negative controls: the raw trainer (what tpdiag compared before), and the filters left out
    s, _ = rollout(tmp_path, rows, path, modes=("decode",))
    assert s["metrics"]["exact_tokens"] == 0 and s["processed"]["detected"] is True
    assert "--sampling" in s["processed"]["explanation"] and "--sampling" in s["what_to_do"]["line"]
    s, _ = rollout(tmp_path, rows, path, modes=("decode",),
                   sampling=(("repetition_penalty", 1.1), ("temperature", 0.8)))
    assert s["closest"]["reproduced"] is False and s["metrics"]["exact_tokens"] == 0


def test_gemma3s_norm_keeps_its_formula_under_the_fixes(tmp_path):
    # Gemma3's q_norm/k_norm compute x * (1 + w); invariant-norm-grad replaced them by w * rms(x): the
    # fixed trainer was another model (max |diff| 0.667 nats against the engine, the stock trainer
    # 0.0113), and at TP=1 alone it failed ("q_norm (heads): reduced dimension 20 is not divisible by
    # 8 groups": the norm's input is [B, heads, S, D] there)
    path = save_bf16("gemma3_text", tmp_path / "g", **ARCHS["gemma3_text"])
    files, _ = engine(path, **SAMPLE)
    s, _ = rollout(tmp_path, files["raw"], path, modes=("prefill",), fixes=("none", "invariant-norm-grad", "all"))
    c = s["configurations"]
    assert c["tp1-mb8-prefill-invariant-norm-grad"].get("same_bits_as") == "tp1-mb8-prefill-none", c
    assert c["tp1-mb8-prefill-all"]["status"] == "ok"
    assert c["tp1-mb8-prefill-all"]["metrics"]["max_abs"] < 0.05, c["tp1-mb8-prefill-all"]["metrics"]
