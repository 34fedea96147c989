"""Planted run-to-run nondeterminism in a backward only, the way fused attention backwards with
atomics behave: layer 0's attention output passes through an op whose forward is exact and
whose backward adds noise seeded by the process id."""
import os

import torch

import tpdiag
from tpdiag.models import tiny_llama


class _NoisyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        n = torch.randn(g.shape, generator=torch.Generator().manual_seed(os.getpid()), dtype=g.dtype)
        return g + 1e-6 * n


def target():
    model = tiny_llama.build("tiny-llama", n_layers=1)
    attn = model.layers[0].attention
    orig = attn.forward

    def noisy(*args, **kwargs):
        return _NoisyGrad.apply(orig(*args, **kwargs))

    attn.forward = noisy
    from tpdiag.models.plans import llama_plan

    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
