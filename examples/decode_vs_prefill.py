"""Decode vs prefill on the built-in tiny-llama: its own KV cache, then the same under `--fix all`.

    python examples/decode_vs_prefill.py

A prompt of 8 tokens in one call, then one token per call through `model.new_kv_cache()`, against
one call over all 16 positions (docs/decode.md).
"""
import torch
import tpdiag

torch.manual_seed(0)
t = tpdiag.builtin_target("tiny-llama")
model = t.model.eval()
ids = torch.randint(0, t.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


def both():
    prefill = model(ids)                                   # one call over the 16 positions
    cache = model.new_kv_cache()
    steps = [model(ids[:, :8], cache=cache)]               # the prompt: positions 0..7
    steps += [model(ids[:, p:p + 1], cache=cache) for p in range(8, 16)]  # one token per call
    return prefill, torch.cat(steps, dim=1)


with torch.no_grad():
    p, d = both()
    print("stock:         bitwise", torch.equal(p, d), " max |diff|", (p - d).abs().max().item())
    with tpdiag.invariant(model, t.plan, fixes="all", tree_groups=1):
        p, d = both()
    print("--fix all:     bitwise", torch.equal(p, d), " max |diff|", (p - d).abs().max().item())
