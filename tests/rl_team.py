"""An RL team's set-up, shared by the rollout tests: a tiny checkpoint saved in bf16 with
save_pretrained, one generate() call over left-padded prompts as an engine runs it, `tpdiag rollout`
over the engine's rows, and the trainer's own forward of the right-padded batch (what tpdiag's
prefill must be bit for bit).
"""
import json

import torch

SAMPLE = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LENS = (5, 8, 6, 7)


def left_padded(vocab_size: int):
    """The prompts of LENS's lengths, drawn with seed 1, left-padded to the longest: (ids, mask)."""
    g = torch.Generator().manual_seed(1)
    P = max(LENS)
    ids = torch.zeros(len(LENS), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(LENS):
        ids[r, P - n:] = torch.randint(3, vocab_size, (n,), generator=g)
        mask[r, P - n:] = 1
    return ids, mask


def save_bf16(kind, out, **extra) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **{**BASE, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper next-token distributions than the default init's
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    model.to(torch.bfloat16).save_pretrained(out)
    return str(out)


def engine(path, eos=2, returns=2, **sample):
    """One generate() call over LENS left-padded, as docs/rl.md writes the file: ({'raw': rows from
    output_logits, 'scores': rows from output_scores}, the model as the trainer loads it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids, mask = left_padded(model.config.vocab_size)
    P = ids.shape[1]
    torch.manual_seed(1)
    res = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=10, eos_token_id=eos,
                         num_return_sequences=returns, output_logits=True, output_scores=True,
                         return_dict_in_generate=True, **sample)
    ids, mask = ids.repeat_interleave(returns, 0), mask.repeat_interleave(returns, 0)
    out = {}
    for name, steps in (("raw", res.logits), ("scores", res.scores)):
        lp = torch.stack(steps, 1).float().log_softmax(-1)
        rows = []
        for b in range(len(ids)):
            prompt = ids[b][mask[b].bool()].tolist()
            new = res.sequences[b, P:].tolist()
            if eos in new:
                new = new[:new.index(eos) + 1]
            rows.append({"input_ids": prompt + new, "prompt_len": len(prompt),
                         "logprobs": [lp[b, j, t].item() for j, t in enumerate(new)]})
        out[name] = rows
    return out, model


def rollout(tmp_path, rows, path, name="r.jsonl", **over):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / name
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    got = {}
    kw = dict(file=str(f), model="hf:" + path, dtype="bfloat16", micro_batch=(len(rows),),
              modes=("decode", "prefill"), fixes=("none",))
    s = run_rollout(RolloutConfig(**{**kw, **over}), on_logprobs=got.update)
    return s, got


def right_padded(rows):
    """The trainer's batch of the rows: right-padded to the longest, with its attention mask (ids, mask)."""
    L = max(len(x["input_ids"]) for x in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(rows):
        ids[i, :len(x["input_ids"])] = torch.tensor(x["input_ids"])
        mask[i, :len(x["input_ids"])] = 1
    return ids, mask


def trainer_logits(model, rows):
    """The user's own forward of the right-padded batch (one call, the attention mask): its logits."""
    ids, mask = right_padded(rows)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def picked(lsm, i, x):
    """Row i's logprob of each of its next tokens, from the batch's log-softmax lsm."""
    return lsm[i, :len(x["input_ids"]) - 1].gather(-1, torch.tensor(x["input_ids"][1:])[:, None])[:, 0]


def same_rows(user, rows, got) -> int:
    """How many sequences tpdiag's logprobs `got` (per row) are the user's [B, L] logprobs bit for bit."""
    return sum(torch.equal(user[i, :len(x["input_ids"]) - 1], got[i]) for i, x in enumerate(rows))
