"""A real rollout engine for `tpdiag rollout`: transformers' generate() with its KV cache.

    python examples/hf_rollout.py /tmp/rollout            # writes the model and the files
    tpdiag rollout /tmp/rollout/rollout.jsonl --model hf:/tmp/rollout/model

Writes a tiny llama (examples/make_tiny_hf.py's config, random weights saved as safetensors)
to OUT/model, samples a few sequences from it with generate() (one prompt per call, KV cache on)
and writes the engine's per-token logprobs of the sampled tokens in each format tpdiag reads:
- OUT/rollout.jsonl: tpdiag's JSONL ({"input_ids", "prompt_len", "logprobs"} per line),
  the raw logprobs: log_softmax of generate()'s raw logits;
- OUT/vllm.json: the same numbers as vLLM's OpenAI chat response (return_token_ids, logprobs,
  prompt_logprobs from the prefill);
- OUT/sglang.json: the same numbers as SGLang /generate responses (meta_info);
- OUT/processed.jsonl: sampled with top-k and logprobs taken from generate()'s processed
  scores - renormalised over the top k, as an engine reporting processed logprobs does.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _make_tiny():
    spec = importlib.util.spec_from_file_location("tpdiag_example_make_tiny_hf",
                                                  os.path.join(_HERE, "make_tiny_hf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_model(out: str, seed: int = 0, scale: float = 8.0, **overrides) -> str:
    """A tiny llama with random weights; `scale` sharpens its next-token distributions (the
    default init is nearly uniform over the vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _make_tiny().write_tiny("llama", out, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(scale)
    model.save_pretrained(path)
    return path


def generate(path: str, n: int = 4, new_tokens: int = 8, seed: int = 1, top_k: int | None = None):
    """[(input_ids, prompt_len, logprobs of the generated tokens, prompt logprobs)] sampled by
    generate() one prompt at a time. top_k None: raw logprobs (top_k=0, temperature 1); an int:
    top-k sampling with logprobs from the processed scores."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # from_pretrained leaves the weights in the safetensors file's memory map, 8-byte aligned;
    # an engine copies them into its own allocations (aligned). On a CPU BLAS the alignment
    # changes the bits of M=1 GEMMs: copied, the engine's weights are laid out as the trainer's.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out = []
    for i in range(n):
        plen = 5 + i % 4
        prompt = torch.randint(0, vocab, (1, plen), generator=g)
        res = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, top_k=top_k or 0, top_p=1.0,
                             temperature=1.0, use_cache=True, output_logits=True, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        ids = res.sequences[0].tolist()
        steps = res.scores if top_k else res.logits
        lps = [float(torch.log_softmax(s[0].float(), -1)[ids[plen + j]]) for j, s in enumerate(steps)]
        with torch.no_grad():  # what an engine's prompt_logprobs are: the prefill's rows
            rows = torch.log_softmax(model(prompt).logits[0].float(), -1)
        plp = [float(rows[t - 1, ids[t]]) for t in range(1, plen)]
        out.append((ids, plen, lps, plp))
    return out


def generate_batch(path: str, dtype: str = "float32", prompt_lens=(5, 8, 6, 7), new_tokens: int = 10,
                   seed: int = 1, attn_implementation: str | None = None, device: str = "cpu"):
    """An engine's batch: the model loaded as a user loads it (from_pretrained(dtype=...)), the
    prompts left-padded in ONE generate() call (attention mask, KV cache, sampled at temperature
    1), and the logprob of each chosen token from generate()'s raw logits (output_logits: float32
    copies of the model's logits) - [(input_ids, prompt_len, logprobs, None)] per sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw).to(device).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    P, B = max(prompt_lens), len(prompt_lens)
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for r, n in enumerate(prompt_lens):
        ids[r, P - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(seed)
    res = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                         use_cache=True, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    out = []
    for r, n in enumerate(prompt_lens):
        seq = res.sequences[r].tolist()
        lps = [float(torch.log_softmax(s[r].float(), -1)[seq[P + j]]) for j, s in enumerate(res.logits)]
        out.append((seq[P - n:], n, lps, None))
    return out


def as_jsonl(seqs) -> str:
    return "".join(json.dumps({"input_ids": ids, "prompt_len": p, "logprobs": lps}) + "\n"
                   for ids, p, lps, _ in seqs)


def as_vllm(seqs) -> list:
    """One OpenAI chat response per sequence, as vLLM gives it with return_token_ids,
    logprobs=true and prompt_logprobs."""
    out = []
    for k, (ids, p, lps, plp) in enumerate(seqs):
        content = [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                   for t, lp in zip(ids[p:], lps)]
        prompt_lps = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": f"<{t}>"}}
                               for t, lp in zip(ids[1:p], plp)]
        out.append({"id": f"chatcmpl-{k}", "object": "chat.completion", "model": "tiny",
                    "prompt_token_ids": ids[:p], "prompt_logprobs": prompt_lps,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                 "logprobs": {"content": content}, "finish_reason": "length",
                                 "token_ids": ids[p:]}]})
    return out


def as_sglang(seqs) -> list:
    return [{"text": "", "meta_info": {
        "prompt_tokens": p, "completion_tokens": len(ids) - p,
        "input_token_logprobs": [[None, ids[0], None]] + [[lp, t, None] for t, lp in zip(ids[1:p], plp)],
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids[p:], lps)]}}
        for ids, p, lps, plp in seqs]


def write_all(out: str, n: int = 4, new_tokens: int = 8, top_k: int = 4) -> dict:
    path = write_model(os.path.join(out, "model"))
    raw = generate(path, n, new_tokens)
    files = {"model": path, "jsonl": os.path.join(out, "rollout.jsonl"),
             "vllm": os.path.join(out, "vllm.json"), "sglang": os.path.join(out, "sglang.json"),
             "processed": os.path.join(out, "processed.jsonl")}
    with open(files["jsonl"], "w") as f:
        f.write(as_jsonl(raw))
    with open(files["vllm"], "w") as f:
        json.dump(as_vllm(raw), f)
    with open(files["sglang"], "w") as f:
        json.dump(as_sglang(raw), f)
    with open(files["processed"], "w") as f:
        f.write(as_jsonl(generate(path, n, new_tokens, seed=2, top_k=top_k)))
    files["sequences"] = raw
    return files


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=4, help="top-k of processed.jsonl")
    a = ap.parse_args()
    files = write_all(a.out, a.sequences, a.new_tokens, a.top_k)
    for k in ("model", "jsonl", "vllm", "sglang", "processed"):
        print(f"{k}: {files[k]}")
