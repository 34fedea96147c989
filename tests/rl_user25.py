"""Our RL team's harness for a small Gemma policy, as we run it (not tpdiag's code).

The policy is saved with save_pretrained and loaded back the way our trainer and our rollout worker
load it: `AutoModelForCausalLM.from_pretrained(DIR, torch_dtype=torch.bfloat16,
attn_implementation="sdpa", use_cache=True)`. The rollout worker is transformers' own generate():
chat-style prompts (BOS, a user turn, the model turn opened) left-padded as a chat tokenizer with
`padding_side="left"` pads them, sampled at temperature 0.7 and top_p 0.9. It reports each sampled
token's logprob at the sampling temperature without the filter (log_softmax(logits / T), as
engines that report "processed" logprobs do), written in tpdiag's JSONL (docs/rl.md).

The trainer pads on the right with the attention mask, divides the bf16 logits by the temperature
in place (as TRL's GRPO and verl do), takes a float32 log-softmax and gathers the next tokens.
`policy()` wraps the same model and logprob for `tpdiag --model py:tests/rl_user25.py:policy`;
`policy_forgets_temperature()` is the trainer after a refactor that dropped the division.

DIR for the py: targets comes from the environment (RL_USER25_DIR), as our launcher passes it.
"""
import json
import os

import torch
import torch.nn.functional as F

PAD, EOS, BOS, START_TURN, END_TURN = 0, 1, 2, 3, 4
VOCAB = 192
TEMPERATURE, TOP_P = 0.7, 0.9
NEW_TOKENS = 10
# chat turns of user text (token ids above the specials), of different lengths
USER_TURNS = ([17, 93, 40], [120, 8, 66, 150, 31, 77], [9, 101, 58, 14], [188, 45, 71, 33, 160])


def make_checkpoint(out_dir, seed=0) -> str:
    """A tiny Gemma (GQA 4/2, tied embeddings) saved in bf16 with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, max_position_embeddings=128, pad_token_id=PAD,
                               eos_token_id=EOS, bos_token_id=BOS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # a policy with opinions: the default init is close to uniform
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(3.0)
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    return str(out_dir)


def load_policy(path, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16,
                                                attn_implementation=attn, use_cache=True).eval()


def chat_prompts():
    return [[BOS, START_TURN, *turn, END_TURN, START_TURN] for turn in USER_TURNS]


def left_pad(prompts):
    """padding_side="left", as our chat tokenizer pads for generation: (input_ids, attention_mask)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate(model, seed=1):
    """The rollout worker: one generate() over the left-padded chat prompts. Returns its output and
    the prompts' (ids, mask)."""
    ids, mask = left_pad(chat_prompts())
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
                         max_new_tokens=NEW_TOKENS, pad_token_id=PAD, eos_token_id=EOS, output_logits=True,
                         output_scores=True, return_dict_in_generate=True)
    return out, ids, mask


def engine_rows(out, ids, mask, report="tempered"):
    """Each sequence as tpdiag's JSONL row: its prompt without the padding, its tokens up to its EOS,
    and the engine's logprob of each. report: 'tempered' log_softmax(logits / T) (what our worker
    reports), 'raw' log_softmax(logits), 'scores' generate()'s processed scores."""
    steps = out.scores if report == "scores" else out.logits
    x = torch.stack(steps, 1).float()
    if report == "tempered":
        x = x / TEMPERATURE
    lp = x.log_softmax(-1)
    P = ids.shape[1]
    rows = []
    for b in range(len(ids)):
        prompt = ids[b][mask[b].bool()].tolist()
        new = out.sequences[b, P:].tolist()
        if EOS in new:
            new = new[:new.index(EOS) + 1]
        rows.append({"input_ids": prompt + new, "prompt_len": len(prompt),
                     "logprobs": [lp[b, j, t].item() for j, t in enumerate(new)]})
    return rows


def write_jsonl(rows, path) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def token_logprobs(logits, input_ids, temperature=TEMPERATURE):
    """Our trainer's logprob function: logits[t] predicts input_ids[t + 1]; the bf16 logits are
    divided by the temperature in place, then a float32 log-softmax is gathered at the next tokens."""
    logits = logits[:, :-1, :]
    logits.div_(temperature)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def trainer_logprobs(model, rows, temperature=TEMPERATURE):
    """The trainer's forward over the rollout: right-padded batch with its mask, one call; returns
    each row's logprobs of its generated tokens."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"])) for r in rows])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        lp = token_logprobs(logits, ids, temperature)
    return [lp[b, r["prompt_len"] - 1:len(r["input_ids"]) - 1] for b, r in enumerate(rows)]


def trainer_dump(model, rows, shifted=True):
    """Our trainer's debug dump of the rollout (T=1), as tpdiag JSONL rows: its logprob of each
    generated token. shifted=False is the version before the fix: the logits gathered at the
    input_ids themselves, no shift."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"])) for r in rows])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        if shifted:
            lp = F.pad(token_logprobs(logits, ids, 1.0), (1, 0))  # lp[:, t]: token t's logprob
        else:
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
    return [{**r, "logprobs": lp[b, r["prompt_len"]:len(r["input_ids"])].tolist()} for b, r in enumerate(rows)]


# ---- the same trainer as tpdiag py: targets ---------------------------------------------------


def _nll_at(temperature):
    def loss(logits, labels):
        """token-mean NLL of the labelled tokens (labels aligned with the logits' rows, -100 ignored)"""
        x = logits / temperature if temperature != 1 else logits
        lp = F.log_softmax(x.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        keep = labels != -100
        return -(lp * keep).sum() / keep.sum()
    return loss


def _target(loss):
    import tpdiag

    model = load_policy(os.environ["RL_USER25_DIR"])
    return tpdiag.Target(model=model, plan=dict(model.tp_plan), vocab_size=model.config.vocab_size, loss=loss)


def policy():
    return _target(_nll_at(TEMPERATURE))


def policy_forgets_temperature():  # the planted bug: the division by T was lost in a refactor
    return _target(_nll_at(1.0))
