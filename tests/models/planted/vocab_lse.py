"""A vocab-parallel cross-entropy written with plain autograd on a hand-written column-parallel LM
head (helper hplant18): each rank holds its rows of the head (a master drawn whole) and returns its
vocab shard of the logits; the loss combines the shards itself. Vocab 32, hidden 32, seq 8.

  max_local   the max taken for stability is NOT all-reduced: each rank subtracts its own shard's
              max, all-reduces sum(exp(z - m_local)) and adds its own m_local back - the ranks' terms
              are scaled by different exp(m_r), so the loss is wrong (and differs across ranks)
              while every logit is right.                                            BUG (loss)
  lse_gather  each rank's own logsumexp, all-gathered and combined with logsumexp over the
              ranks - the same function, summed in another order.                    rounding

    tpdiag compare --model py:tests/models/planted/vocab_lse.py:max_local --tp 1,2
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, the ranks' partial input grads all-reduced in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Sum(torch.autograd.Function):
    """Megatron's g: all-reduce SUM forward; the loss is the same on every rank, so backward passes
    its grad through."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Gather(torch.autograd.Function):
    """All-gather along a new first dim; backward keeps this rank's row of the (replicated) grad."""

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


class ColumnHead(nn.Module):
    def __init__(self):
        super().__init__()
        r, n = rank_world()
        per = VOCAB // n
        self.weight = nn.Parameter((torch.randn(VOCAB, DIM) / DIM ** 0.5)[r * per:(r + 1) * per].clone())

    def forward(self, x):
        return (_Copy.apply(x) if rank_world()[1] > 1 else x) @ self.weight.t()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = ColumnHead()

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def parallel_ce(logits, labels, how):
    r, n = rank_world()
    z, y = logits.flatten(0, -2).float(), labels.flatten()
    per = z.shape[-1]
    outside = (y < r * per) | (y >= (r + 1) * per)
    local = (y - r * per).masked_fill(outside, 0)
    picked = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
    if n == 1:
        return (torch.logsumexp(z, -1) - picked).mean()
    picked = _Sum.apply(picked)
    if how == "max_local":
        m = z.detach().amax(-1, keepdim=True)          # this shard's max only
        lse = m.squeeze(-1) + _Sum.apply((z - m).exp().sum(-1)).log()
    else:
        lse = torch.logsumexp(_Gather.apply(torch.logsumexp(z, -1)), 0)
    return (lse - picked).mean()


def _target(how):
    return tpdiag.Target(model=LM(), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         loss=lambda logits, labels: parallel_ce(logits, labels, how))


def max_local():
    return _target("max_local")


def lse_gather():
    return _target("lse_gather")
