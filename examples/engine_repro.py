"""Does `tpdiag rollout` reproduce a real engine bit for bit? transformers' generate() is the engine.

    python examples/engine_repro.py /tmp/repro                 # a GPU: Llama-3.2-1B-shaped, bf16
    python examples/engine_repro.py /tmp/repro --small --device cpu   # a tiny llama, seconds
    python examples/engine_repro.py /tmp/repro --moe           # a GPU: Qwen3-MoE-shaped, bf16

1. writes a checkpoint (random weights, saved in bf16 with save_pretrained; Llama-3.2-1B's shape:
   hidden 2048, 16 layers, 32/8 heads of 64, ffn 8192, vocab 128256, tied head, rope_theta 5e5
   with llama3 rope scaling);
2. the engine: from_pretrained(dtype=bfloat16), ONE generate() call over a batch of 4 prompts of
   64 tokens, 128 new tokens, sampled at temperature 1 with the KV cache; the logprob of each
   chosen token from its raw logits (output_logits) - written as tpdiag's JSONL;
3. runs `tpdiag rollout FILE --model hf:DIR --dtype bfloat16 --tp 1 --micro-batch 4,1 --mode
   prefill,decode --fix none` (PyTorch's default flags, as generate() ran) and prints the table,
   N/N exact per configuration and the closest configuration. Expected: tp1-mb4-decode-none
   reproduces every token (exact N/N, token_mult_prob_error exactly 1) and is named closest.
Extra arguments after `--` go to `tpdiag rollout` (e.g. `-- --flags default,deterministic`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
            "mlp_bias": False, "initializer_range": 0.02, "bos_token_id": 128000,
            "eos_token_id": 128001, "dtype": "bfloat16"}
# --moe: Qwen3-MoE-shaped (a scaled-down Qwen3-30B-A3B: 16 experts, 4 per token); on a GPU generate()
# runs its decode steps with the experts' batched_mm instead of grouped_mm (_optimize_model_for_decode)
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
             "intermediate_size": 3072, "moe_intermediate_size": 384, "num_experts": 16,
             "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
             "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
             "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}
SMALL_MOE = {**QWEN3_MOE, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
SMALL = {**LLAMA_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 16, "vocab_size": 512,
         "bos_token_id": 1, "eos_token_id": 2}


def write_checkpoint(path: str, config: dict, device: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # sharper next-token distributions than the near-uniform init
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def engine(path: str, out: str, batch: int, prompt: int, new: int, device: str, sampling: str = "") -> int:
    """generate() as an engine runs it; writes tpdiag's JSONL; returns the tokens generated.
    sampling: 'temperature=0.8,top_p=0.95,...' - generate() samples with these and the logprobs
    come from its processed scores (output_scores), as `tpdiag rollout --sampling` recomputes them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    torch.manual_seed(2)
    t0 = time.perf_counter()
    settings = {"top_k": 0, "top_p": 1.0, "temperature": 1.0}
    for item in filter(None, sampling.split(",")):
        key, _, value = item.partition("=")
        settings[key.strip()] = int(value) if key.strip() in ("top_k", "no_repeat_ngram_size") else float(value)
    if sampling:
        # no EOS: every sequence `new` tokens, without min_new_tokens' processor in the scores
        model.generation_config.eos_token_id = None
    else:
        settings["min_new_tokens"] = new
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=True,
                         use_cache=True, output_logits=True, output_scores=bool(sampling),
                         return_dict_in_generate=True, pad_token_id=0, **settings)
    print(f"engine: generate() {batch} x ({prompt} + {new}) in {time.perf_counter() - t0:.1f} s", flush=True)
    with open(out, "w") as f:
        for r in range(batch):
            seq = res.sequences[r].tolist()
            steps = res.scores if sampling else res.logits
            lps = [float(torch.log_softmax(s[r].float(), -1)[seq[prompt + j]]) for j, s in enumerate(steps)]
            f.write(json.dumps({"input_ids": seq, "prompt_len": prompt, "logprobs": lps}) + "\n")
    return batch * new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--small", action="store_true", help="a tiny llama (CPU, seconds)")
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped model instead of the llama")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--sampling", default="", help="generate()'s settings (temperature=0.8,top_p=0.95,...): "
                                                   "logprobs from its processed scores, rollout run with --sampling")
    argv = sys.argv[1:]
    # argparse gives a trailing nargs="*" positional nothing once the one before it has matched: the
    # options after `--` are split off here
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.rest = argv[cut + 1:]  # after --: more tpdiag rollout options
    shape = (SMALL_MOE if a.small else QWEN3_MOE) if a.moe else (SMALL if a.small else LLAMA_1B)
    model = write_checkpoint(os.path.join(a.out, "model"), shape, a.device)
    rollout = os.path.join(a.out, "rollout.jsonl")
    n = engine(model, rollout, a.batch, a.prompt, a.new, a.device, a.sampling)
    if a.sampling:
        a.rest = ["--sampling", a.sampling, *a.rest]
    cmd = [sys.executable, "-m", "tpdiag", "rollout", rollout, "--model", f"hf:{model}", "--dtype", "bfloat16",
           "--device", a.device, "--tp", "1", "--micro-batch", f"{a.batch},1", "--mode", "prefill,decode",
           "--fix", "none", "--format", "json", *a.rest]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:])
        return p.returncode
    s = json.loads(p.stdout)
    print(f"tpdiag rollout: {time.perf_counter() - t0:.1f} s")
    for f in s.get("flags", {}).values():
        print(f["line"])
    for label, r in s["configurations"].items():
        if r["status"] != "ok":
            print(f"  {label}: {r['status']}: {r.get('reason')}")
            continue
        m = r["metrics"]
        print(f"  {label}: exact {m['exact_tokens']}/{m['tokens']}  token_mult_prob_error "
              f"{m['token_mult_prob_error']!r}  max |diff| {m['max_abs']:.3g}")
    print(f"closest: {s['closest']['explanation']}")
    ok = s["closest"]["reproduced"] and f"tp1-mb{a.batch}-decode-none" in s["closest"]["configurations"]
    print("REPRODUCED" if ok else "NOT REPRODUCED", f"({n} generated tokens)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
