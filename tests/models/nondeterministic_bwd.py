"""Planted run-to-run nondeterminism in a backward only, the way fused attention backwards with
atomics behave (dq noisy; dk, dv and the forward exact): the query that layer 0's attention
kernel sees passes through an op whose forward is exact and whose backward adds noise seeded
by the process id. As on a GPU, the noisy dq reaches wq's grad_out record after wv's and wk's
bitwise ones."""
import os

import torch
import torch.nn.functional as F

import tpdiag
from tpdiag.models import tiny_llama


_CALLS = [0]


class _NoisyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        # a new draw every backward, as atomics' order changes run to run: the probed and the
        # unprobed step of one world differ too (the self-check), not only two worlds
        _CALLS[0] += 1
        seed = os.getpid() * 1000 + _CALLS[0]
        n = torch.randn(g.shape, generator=torch.Generator().manual_seed(seed), dtype=g.dtype)
        return g + 1e-6 * n


def target():
    model = tiny_llama.build("tiny-llama", n_layers=1)
    sdpa = F.scaled_dot_product_attention
    if not getattr(sdpa, "_noisy", False):  # target() may be called more than once per process

        def noisy_sdpa(q, k, v, *args, **kwargs):
            return sdpa(_NoisyGrad.apply(q), k, v, *args, **kwargs)

        noisy_sdpa._noisy = True
        F.scaled_dot_product_attention = noisy_sdpa  # this world's process only
    from tpdiag.models.plans import llama_plan

    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
