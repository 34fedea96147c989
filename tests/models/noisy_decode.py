"""A decode step that is not reproducible run to run: each one-token call (through the KV
cache) adds noise drawn from a fresh seed to its logits, as a sampling-side bug or an atomic
split-KV kernel would. Prefill (no cache) is exact. The decode world's self-check (its unprobed
run against its probed run) must catch it."""
import os

import torch

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan

class NoisyDecode(tiny_llama.TinyLlama):
    def forward(self, input_ids, cache=None):
        out = super().forward(input_ids, cache=cache)
        if cache is not None and input_ids.shape[1] == 1:
            # a fresh draw every call, run to run (the file may be imported anew per run)
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            out = out + 1e-3 * torch.randn(out.shape, generator=g, dtype=out.dtype)
        return out


def target():
    cfg = tiny_llama.LlamaConfig(**{**tiny_llama.PRESETS["tiny-llama"], "n_layers": 1})
    model = NoisyDecode(cfg)
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=cfg.vocab_size)
