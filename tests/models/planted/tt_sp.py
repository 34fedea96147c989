"""A torchtitan-style block under sequence parallelism, handed to `tpdiag compare` as a Target: the
residual stream sharded on the sequence between norms (`SequenceParallel`), q/k/v column-parallel
after a `PrepareModuleInput` that gathers the sequence, the output head tied to the embedding.

  good        the plan as torchtitan writes it; head and embedding two weights (no tie)
  sp_noprep   the attention's `PrepareModuleInput` left out and its norm's output local
              (`SequenceParallel(use_local_output=True)`): q/k/v take each rank's sequence shard for
              the whole sequence - each rank attends within its own positions only
  tie_before  the good plan on a model whose head is tied to the embedding before it:
              `parallelize_module` gives the head and the embedding a Parameter each, trained apart
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, H, FF, B, S = 32, 32, 4, 64, 2, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x):
        bs, s, _ = x.shape
        q, k, v = (w(x).view(bs, s, -1, D // H).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, s, -1))


class LM(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.attention_norm = nn.RMSNorm(D, eps=1e-5)
        self.attention = Attention()
        self.norm = nn.RMSNorm(D, eps=1e-5)
        self.output = nn.Linear(D, V, bias=False)
        if tied:
            self.output.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.attention(self.attention_norm(h))
        return self.output(self.norm(h))


def _plan(prep=True):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    if not prep:
        del plan["attention"]
        plan["attention_norm"] = SequenceParallel(use_local_output=True)
        plan["attention.wo"] = RowwiseParallel()
    return plan


def _target(model, plan):
    return tpdiag.Target(model=model, plan=plan, vocab_size=V,
                         inputs=lambda g: torch.randint(0, V, (B, S), generator=g))


def good():
    return _target(LM(), _plan())


def sp_noprep():
    return _target(LM(), _plan(prep=False))


def tie_before():
    return _target(LM(tied=True), _plan())
