"""Megatron's tied embedding written by hand (helper hplant18): ONE vocab-parallel weight - rank r
holds rows [r V/n, (r+1) V/n) of a master drawn whole - is the input embedding (ids outside the
rank's rows masked to zero rows, the ranks' lookups all-reduced) and the LM head (the same shard,
its logits left a vocab shard: `forward(tokens)` returns each rank's logits), with a vocab-parallel
cross-entropy. The tied weight's grad is the sum of both uses. Vocab 32, dim 32, ffn 64, seq 8.

  tied_ok   the lookup's all-reduce is Megatron's g (identity backward: the loss is the same on
            every rank, each rank's grad of the sum is already whole).              rounding
  tied_dfn  the lookup summed with `torch.distributed.nn.functional.all_reduce`, whose backward
            all-reduces the grad too: the embedding's share of the tied grad is TP x itself;
            the head's share is right.                                             BUG (backward)

    tpdiag compare --model py:tests/models/planted/tied_vocab.py:tied_dfn --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        r, n = rank_world()
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous())
        ctx.r = r
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.r].contiguous()


class TiedVocab(nn.Module):
    def __init__(self, dfn):
        super().__init__()
        r, n = rank_world()
        self.per = VOCAB // n
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM)[r * self.per:(r + 1) * self.per].clone())
        self.dfn = dfn

    def embed(self, ids):
        r, n = rank_world()
        if n == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < r * self.per) | (ids >= (r + 1) * self.per)
        e = F.embedding((ids - r * self.per).masked_fill(outside, 0), self.weight)
        e = e.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.dfn:
            import torch.distributed.nn.functional as dfn

            return dfn.all_reduce(e)
        return _Reduce.apply(e)

    def logits(self, x):
        return (_Copy.apply(x) if rank_world()[1] > 1 else x) @ self.weight.t()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    def __init__(self, dfn):
        super().__init__()
        self.vocab = TiedVocab(dfn)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):
        x = self.vocab.embed(tokens)
        return self.vocab.logits(self.norm(x + self.mlp(x)))


def parallel_ce(logits, labels):
    r, n = rank_world()
    z, y = logits.flatten(0, -2).float(), labels.flatten()
    per = z.shape[-1]
    outside = (y < r * per) | (y >= (r + 1) * per)
    picked = z.gather(1, (y - r * per).masked_fill(outside, 0).unsqueeze(1)).squeeze(1)
    picked = picked.masked_fill(outside, 0.0)
    if n == 1:
        return (torch.logsumexp(z, -1) - picked).mean()
    lse = torch.logsumexp(_Gather.apply(torch.logsumexp(z, -1)), 0)
    return (lse - _Reduce.apply(picked)).mean()


def _target(dfn):
    return tpdiag.Target(model=LM(dfn), plan={}, vocab_size=VOCAB, loss=parallel_ce,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def tied_ok():
    return _target(False)


def tied_dfn():
    return _target(True)
