"""An RL team whose engine reports logprobs at its sampling temperature T (generate()'s output_scores
with no filter, vLLM's processed logprobs) and whose trainer divides its logits by T before the
log-softmax. tpdiag names the temperature, and the command it gives - `--sampling
temperature=T,top_k=0` - reproduces the engine bit for bit, with the trainer's prefill the user's own
`(logits.float() / T).log_softmax(-1)` bit for bit. Before, the line said `--sampling
temperature=T,top_k=K,...`; `--sampling temperature=T` alone takes generate()'s default top_k=50,
which cuts half the engine's tokens here (the control). A trainer dividing its bf16 logits by T
before upcasting rounds the quotient to bf16 first: not these bits (a second control)."""
import pytest
import torch

pytest.importorskip("transformers")

from tests.rl_team import engine, picked, rollout, save_bf16, trainer_logits  # noqa: E402

T = 0.7


def test_a_temperature_rollout_is_reproduced_with_the_command_tpdiag_names(tmp_path):
    path = save_bf16("qwen2", tmp_path / "q")
    files, model = engine(path, temperature=T, top_k=0)
    rows = files["scores"]
    n = sum(len(x["logprobs"]) for x in rows)
    s, _ = rollout(tmp_path, rows, path, modes=("decode",))
    pr = s["processed"]
    assert pr["kind"] == "temperature" and pr["temperature_fit"] == T, pr
    assert f"--sampling temperature={T:g},top_k=0" in pr["explanation"], pr["explanation"]
    s, got = rollout(tmp_path, rows, path, sampling=(("temperature", T), ("top_k", 0)))
    m = s["configurations"]["tp1-mb8-decode-none"]["metrics"]
    assert m["exact_tokens"] == m["tokens"] == n and s["closest"]["reproduced"], m
    # the trainer: tpdiag's prefill is the user's own forward, float32 logits divided by T
    logits = trainer_logits(model, rows)
    assert logits.dtype == torch.bfloat16

    def completion(lsm, i, x):
        return picked(lsm, i, x)[x["prompt_len"] - 1:]

    fp32 = (logits.float() / T).log_softmax(-1)
    bf16 = (logits / T).float().log_softmax(-1)
    pre = got["tp1-mb8-prefill-none"]
    for i, x in enumerate(rows):
        assert torch.equal(completion(fp32, i, x), pre[i][x["prompt_len"] - 1:]), i
    assert not any(torch.equal(completion(bf16, i, x), pre[i][x["prompt_len"] - 1:]) for i, x in enumerate(rows))
    # control: the temperature alone takes generate()'s default top_k=50 - not the engine's filter
    s, _ = rollout(tmp_path, rows, path, modes=("decode",), sampling=(("temperature", T),))
    m = s["configurations"]["tp1-mb8-decode-none"]["metrics"]
    assert not s["closest"]["reproduced"] and m.get("filtered_out"), m
