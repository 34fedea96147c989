"""Planted rank-inconsistent replica: a replicated norm whose output depends on the rank
(as a per-rank dropout seed or an unsynchronised buffer would make it)."""
import torch
import torch.distributed as dist

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


def target():
    model = tiny_llama.build("tiny-llama", n_layers=1)
    norm = model.layers[0].ffn_norm
    orig = norm.forward

    def noisy(x):
        rank = dist.get_rank() if dist.is_initialized() else 0
        g = torch.Generator().manual_seed(1000 + rank)
        return orig(x) + 1e-3 * torch.randn(x.shape, generator=g, dtype=x.dtype)

    norm.forward = noisy
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
