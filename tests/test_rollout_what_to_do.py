"""`tpdiag rollout`'s `what to do:` line (tpdiag.rollout.todo), on rollouts written by transformers'
own generate() (a tiny Llama saved with save_pretrained, a left-padded sampled batch of 4 through
its KV cache): a new user's trial read `reproduced: tp1-mb8-decode-none` while the trainer's own
configuration (the reference, tried first) was not, and nothing said what to do. Each case of the
line: the trainer's configuration reproduces the engine (nothing to do); another does (the
settings that differ, what each means, the gap in NeMo RL's terms); none does (what that implies,
what to try first)."""
import json

import pytest
import torch
from conftest import run_cli

pytest.importorskip("transformers")

LENS, NEW = (5, 8, 6, 7), 8


def _checkpoint(out, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper next-token distributions than the default init's
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    model.to(dtype).save_pretrained(out)
    return str(out)


def _engine(path, dtype, out):
    """The user's engine: one generate() of a left-padded batch, sampled; each chosen token's
    logprob from output_logits, as tpdiag JSONL."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    P = max(LENS)
    ids = torch.zeros(len(LENS), P, dtype=torch.long)
    mask = torch.zeros(len(LENS), P, dtype=torch.long)
    for r, n in enumerate(LENS):
        ids[r, P - n:] = torch.randint(3, 128, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(1)
    res = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                         top_k=0, top_p=1.0, temperature=1.0, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    rows = []
    for r, n in enumerate(LENS):
        seq = res.sequences[r].tolist()
        lps = [float(torch.log_softmax(s[r].float(), -1)[seq[P + j]]) for j, s in enumerate(res.logits)]
        rows.append({"input_ids": seq[P - n:], "prompt_len": n, "logprobs": lps})
    out.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(out)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp32")
    model = _checkpoint(d / "model", torch.float32)
    return model, _engine(model, torch.float32, d / "rollout.jsonl")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    model = _checkpoint(d / "model", torch.bfloat16)
    return model, _engine(model, torch.bfloat16, d / "rollout.jsonl")


def _rollout(ckpt, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    model, f = ckpt
    return run_rollout(RolloutConfig(file=f, model="hf:" + model, fixes=("none",), top=0, **kw))


def _exact(s, label):
    m = s["configurations"][label]["metrics"]
    return m["exact_tokens"], m["tokens"]


def test_trainer_at_the_engines_settings_has_nothing_to_do(fp32):
    s = _rollout(fp32, micro_batch=(4,), modes=("decode", "prefill"))
    assert s["reference"] == "tp1-mb4-decode-none" and _exact(s, "tp1-mb4-decode-none") == (32, 32)
    todo = s["what_to_do"]
    assert todo["case"] == "nothing" and todo["trainer"] == "tp1-mb4-decode-none" and todo["differs"] == []
    assert todo["line"].startswith("nothing to do: the trainer's configuration (tp1-mb4-decode-none) computes "
                                   "the engine's logprobs bit for bit (32/32")


def test_prefill_trainer_is_told_the_mode_and_the_gap(fp32):
    # negative control of the above: the same engine, the trainer scoring in one prefill call
    s = _rollout(fp32, micro_batch=(4,), modes=("prefill", "decode"))
    assert s["reference"] == "tp1-mb4-prefill-none"
    exact, n = _exact(s, "tp1-mb4-prefill-none")
    assert exact < n  # the premise: prefill is not the engine's bits
    todo = s["what_to_do"]
    assert todo["case"] == "settings" and todo["engine_like"] == "tp1-mb4-decode-none"
    assert [(d["axis"], d["trainer"], d["engine"]) for d in todo["differs"]] == [("mode", "prefill", "decode")]
    e = s["configurations"]["tp1-mb4-prefill-none"]["metrics"]["token_mult_prob_error"]
    assert todo["token_mult_prob_error"] == e and todo["threshold"] == 1.05
    line = todo["line"]
    assert "mode prefill -> decode: your trainer scores each micro-batch in one prefill call" in line
    assert "rounding, harmless unless you need bitwise" in line
    assert f"reads token_mult_prob_error {e:.7f} ({exact}/{n} exact): within NeMo RL's 1.05" in line


def test_micro_batch_is_named_with_the_engines_batch(fp32):
    s = _rollout(fp32, micro_batch=(1, 4), modes=("decode",))
    exact, n = _exact(s, "tp1-mb1-decode-none")
    assert exact < n and _exact(s, "tp1-mb4-decode-none") == (n, n)
    todo = s["what_to_do"]
    assert todo["case"] == "settings"
    assert [(d["axis"], d["trainer"], d["engine"]) for d in todo["differs"]] == [("micro_batch", 1, 4)]
    assert "micro-batch 1 -> 4: your trainer runs 1 sequence per forward call, the engine's numbers are " \
           "those of 4 per call (its whole batch)" in todo["line"]


def test_two_settings_are_named_each(fp32):
    s = _rollout(fp32, micro_batch=(1, 4), modes=("prefill", "decode"))
    todo = s["what_to_do"]
    assert todo["trainer"] == "tp1-mb1-prefill-none" and todo["engine_like"] == "tp1-mb4-decode-none"
    assert [d["axis"] for d in todo["differs"]] == ["micro_batch", "mode"]
    assert "they differ in 2 settings. micro-batch 1 -> 4: " in todo["line"]
    assert "; mode prefill -> decode: " in todo["line"]


def test_nothing_reproduces_names_what_was_not_tried(fp32):
    s = _rollout(fp32, micro_batch=(4,), modes=("prefill",))
    todo = s["what_to_do"]
    assert s["closest"]["reproduced"] is False and todo["case"] == "none" and todo["engine_like"] is None
    assert todo["line"].startswith("nothing tried reproduces the engine")
    assert "--mode decode" in todo["line"] and "--micro-batch 4" not in todo["line"]  # 4 was tried
    assert "raw logprobs" not in todo["line"] and "dtype the checkpoint" not in todo["line"]  # no such lead here


def test_every_axis_has_words_of_its_own():
    # an axis added to the configuration type later must say what it means, not the fallback
    from tpdiag.base.configs import AXES, Config
    from tpdiag.rollout.todo import OTHER_AXIS, _meaning

    a, b = Config(1, 4, "prefill", "none"), Config(2, 1, "decode", "all", "deterministic", "eager", "left")
    for axis in AXES:
        words = _meaning(axis, getattr(a, axis), getattr(b, axis), a, b, 4)
        assert words != OTHER_AXIS and "rounding" in words, axis


def test_bf16_checkpoint_in_float32_says_the_dtype_first(bf16):
    s = _rollout(bf16, micro_batch=(4,), modes=("decode",))  # --dtype float32: the default
    todo = s["what_to_do"]
    assert todo["case"] == "none"
    assert "First run again with the dtype the checkpoint is saved in (the checkpoint note above)" in todo["line"]
    assert any(n.startswith("the checkpoint is saved in bfloat16") for n in s["notes"])
    # control: the dtype it is saved in, as generate() ran it - reproduced, nothing to do
    s = _rollout(bf16, micro_batch=(4,), modes=("decode",), dtype="bfloat16")
    assert s["what_to_do"]["case"] == "nothing" and _exact(s, "tp1-mb4-decode-none") == (32, 32)


def test_cli_prints_the_line_last_and_json_has_it(fp32):
    model, f = fp32
    args = ("rollout", f, "--model", "hf:" + model, "--micro-batch", "4", "--fix", "none", "--top", "0")
    p = run_cli(*args, env={"COLUMNS": "400"})
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("what to do: the engine's logprobs are tp1-mb4-decode-none's bit for bit"), last
    from tpdiag.base import files as io
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    # --format json writes the summary as it is: the field survives strict JSON
    s = run_rollout(RolloutConfig(file=f, model="hf:" + model, micro_batch=(4,), fixes=("none",), top=0))
    assert json.loads(io.dumps(s))["what_to_do"]["line"] == last[len("what to do: "):]


def test_gap_over_nemo_rls_threshold_says_so():
    from tpdiag.rollout.todo import _gap

    m = {"token_mult_prob_error": 1.0512, "exact_tokens": 0, "tokens": 24}
    assert _gap(m, ", from these settings alone").endswith("over NeMo RL's 1.05 for a healthy run, from these "
                                                           "settings alone")
    m["token_mult_prob_error"] = 1.05  # NeMo RL flags above 1.05, not at it
    assert _gap(m, ", from these settings alone").endswith("within NeMo RL's 1.05 for a healthy run")
