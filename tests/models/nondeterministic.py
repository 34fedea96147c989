"""Planted run-to-run nondeterminism: noise seeded by the process id in one norm."""
import os

import torch

import tpdiag
from tpdiag.models import tiny_llama


def target():
    model = tiny_llama.build("tiny-llama", n_layers=1)
    norm = model.layers[0].ffn_norm
    orig = norm.forward

    def noisy(x):
        g = torch.Generator().manual_seed(os.getpid())
        return orig(x) + 1e-6 * torch.randn(x.shape, generator=g, dtype=x.dtype)

    norm.forward = noisy
    from tpdiag.models.plans import llama_plan

    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
