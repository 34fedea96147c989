"""An RL team's trainer that scores generate()'s left-padded `sequences` rows and dumps the logprobs
for `tpdiag rollout` (each sequence's own tokens, as docs/rl.md says). Its classic padding bug: the
rows run without the attention mask (the pads attended, positions counted from the pad), or with
the mask but no position_ids (transformers then numbers positions 0..L-1 from the pad). rollout
said only "not reproduced ... not shown to be rounding ... within NeMo RL's 1.05 for a healthy run".
It now names the mistake (rollout/pad_unmasked.py), leads what-to-do with the fix and does not call
the run healthy. Positions from the pad with the mask passed are a bug where the model reads
absolute positions (GPT-2's learned table); a RoPE model reads them relative to each other, so the
Llama's positions dump is the same function (float64) - named as what the file is, and rounding.
The correct trainer's dump is not named and is reproduced by the left-padded prefill (--padding left).
"""
import json

import pytest
import torch

pytest.importorskip("transformers")

PROMPTS, NEW = (3, 6, 5), 5


def _policy(arch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":  # learned absolute positions
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        **ids))


# llama_bf16: saved and loaded in bf16, the trial's shape - its positions dump read token_mult_prob_error
# ~1.02 and "within NeMo RL's 1.05 for a healthy run" with nothing to say why
@pytest.fixture(scope="module", params=["llama", "gpt2", "llama_bf16"])
def dumps(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("padtrainer")
    torch.manual_seed(0)
    m = _policy(request.param.split("_")[0])
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3)  # a policy with opinions: positions and context move its logprobs
    dtype = torch.bfloat16 if request.param.endswith("bf16") else torch.float32
    m.to(dtype).save_pretrained(d / "model")
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=dtype).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in PROMPTS]
    P = max(PROMPTS)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    torch.manual_seed(3)
    res = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW, min_new_tokens=NEW,
                         top_k=0, return_dict_in_generate=True)
    seqs = res.sequences  # [batch, P + NEW], left-padded; the trainer scores these rows
    full_mask = torch.cat([mask, torch.ones(len(prompts), NEW, dtype=torch.long)], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        trainer = {
            "unmasked": model(seqs).logits,                                  # no mask, no position_ids
            "positions": model(seqs, attention_mask=full_mask).logits,       # the mask, no position_ids
            "correct": model(seqs, attention_mask=full_mask, position_ids=pos).logits,
        }
    files = {}
    for name, logits in trainer.items():
        lp = logits.float().log_softmax(-1)
        lines = []
        for b, p in enumerate(prompts):
            new = seqs[b, P:].tolist()
            lps = [lp[b, P + j - 1, t].item() for j, t in enumerate(new)]
            lines.append(json.dumps({"input_ids": p + new, "prompt_len": len(p), "logprobs": lps}))
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        files[name] = str(d / f"{name}.jsonl")
    return "hf:" + str(d / "model"), files, request.param


def _rollout(model, path, arch, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    kw = {"micro_batch": (3,), "modes": ("prefill",), "fixes": ("none",), **kw}
    dtype = "bfloat16" if arch.endswith("bf16") else "float32"  # as the checkpoint is saved
    return run_rollout(RolloutConfig(file=path, model=model, dtype=dtype, **kw))


@pytest.mark.parametrize("name, words", [
    ("unmasked", "ran the left padding unmasked"),
    ("positions", "with positions counted from the pad"),
])
def test_a_trainer_that_ran_left_padding_wrong_is_named(dumps, name, words):
    model, files, arch = dumps
    s = _rollout(model, files[name], arch)
    assert not s["closest"]["reproduced"]
    bug = s.get("left_padding") or {}
    assert bug.get("variant") == name, bug
    assert bug["exact_tokens"] == bug["tokens"] > 0, bug  # the trainer's own numbers, bit for bit
    assert words in bug["line"] and bug["line"] in s["notes"], bug
    line = s["what_to_do"]["line"]
    if name == "positions" and arch.startswith("llama"):  # RoPE: a shift of every position is the same function
        assert bug["bug"] is False and bug["float64_max_abs"] < 1e-5, bug  # transformers takes RoPE's cos/sin in float32
        assert "rounding, not a bug" in bug["line"] and "pass the attention mask" not in line, line
        assert line.startswith("no configuration tried reproduces the file, but the left padding note above does"), line
        assert "First to match bitwise, pass position_ids" in line and "for a healthy run" in line, line
        return
    assert bug["bug"] is True and bug["float64_max_abs"] > 1e-2, bug
    assert "a bug, not rounding" in bug["line"], bug["line"]
    assert "First pass the attention mask" in line, line
    assert "healthy run" not in line, line  # never called healthy (it read "within ... for a healthy run")
    assert "not shown to be rounding" not in line, line
    assert not any(w["near_tie"] for w in s["worst_tokens"])


def test_the_correct_trainer_is_not_named_and_is_reproduced_left_padded(dumps):
    model, files, arch = dumps
    s = _rollout(model, files["correct"], arch)
    assert s.get("left_padding") is None and not any("left padding" in n for n in s["notes"]), s["notes"]
    s = _rollout(model, files["correct"], arch, padding=("auto", "left"))
    assert s["closest"]["reproduced"] and "tp1-mb3-prefill-none-padleft" in s["closest"]["configurations"], s["closest"]
    assert s.get("left_padding") is None
