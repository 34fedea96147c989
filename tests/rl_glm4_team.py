"""An RL team's rollout and trainer for a tiny GLM-4 policy, as the team writes them: the policy saved
with save_pretrained and loaded back with plain from_pretrained, transformers' generate() as the
engine (sampling at temperature 0.8, top_k 20, over left-padded prompts), each token's logprob from
its raw output_logits (docs/rl.md's snippet), and a trainer that scores generate()'s left-padded
`sequences` rows and dumps the sampled tokens' logprobs in tpdiag's JSONL.

The trainer's recipes: `correct` (mask, position_ids from each row's first real token, float32
log-softmax), `bf16_logprob` (the same logits, log-softmax taken in bf16 - TRL's and verl's row loop
for bf16 logits), and `bf16_unmasked` (a real bug - no attention mask, positions from the pad -
whose logprobs are then stored in bf16); and `engine_at_T`, an engine that reports its sampling
distribution's logprobs at T (output_logits / T, no filter) to a trainer that forgets T, and
`engine_scores`, generate()'s processed output_scores (T and top_k)."""
import json

import torch

PROMPTS, NEW, T, TOP_K = (5, 8, 6, 7), 8, 0.8, 20


def make(d, dtype=torch.float32) -> dict:
    """Save the policy under d/model and write d/NAME.jsonl for the engine and each trainer recipe."""
    from transformers import AutoModelForCausalLM, Glm4Config, Glm4ForCausalLM

    torch.manual_seed(0)
    cfg = Glm4Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2)
    m = Glm4ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3)  # a policy with opinions: its logprobs move with context and position
    m.to(dtype).save_pretrained(d / "model")
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=dtype).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPTS]
    P = max(PROMPTS)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    torch.manual_seed(3)
    res = model.generate(ids, attention_mask=mask, do_sample=True, temperature=T, top_k=TOP_K, max_new_tokens=NEW,
                         min_new_tokens=NEW, output_logits=True, output_scores=True, return_dict_in_generate=True)
    seqs = res.sequences
    full = torch.cat([mask, torch.ones(len(prompts), NEW, dtype=torch.long)], 1)
    pos = (full.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(seqs, attention_mask=full, position_ids=pos).logits
        unmasked = model(seqs).logits
    raw = torch.stack(res.logits, 1).float()  # [batch, NEW, vocab]: generate()'s raw output_logits
    engines = {"engine": raw.log_softmax(-1),
               "engine_at_T": (raw / T).log_softmax(-1),  # the sampling distribution's logprobs, no filter
               "engine_scores": torch.stack(res.scores, 1).float().log_softmax(-1)}  # processed: T, top_k
    trainer = {"correct": logits.float().log_softmax(-1),
               "bf16_logprob": logits.bfloat16().log_softmax(-1).float(),
               "bf16_unmasked": unmasked.float().log_softmax(-1).bfloat16().float()}
    files = {}
    for name in (*engines, *trainer):
        with open(d / f"{name}.jsonl", "w") as f:
            for b, p in enumerate(prompts):
                new = seqs[b, P:].tolist()
                lps = ([engines[name][b, j, t].item() for j, t in enumerate(new)] if name in engines else
                       [trainer[name][b, P + j - 1, t].item() for j, t in enumerate(new)])  # row t-1 predicts t
                f.write(json.dumps({"input_ids": p + new, "prompt_len": len(p), "logprobs": lps}) + "\n")
        files[name] = str(d / f"{name}.jsonl")
    return files
