"""A hand-written column-parallel LM head with `gather_output=True` over a padded vocabulary (helper
hbug9): 31 ids padded to a multiple of 8 * TP (32 at TP=1 and TP=2), the padding rows zero; each rank
computes its 16 columns and all-gathers them, so every rank returns the whole padded logits [.., 32].
The user then masks the padding's logits to -inf, each rank only the padding ids of ITS OWN vocab range
(the range it computed) - rank 0's range holds no padding, so on rank 0 id 31's logit stays 0 and on
rank 1 it is -inf. The padding is no token (labels and sampling never reach it): the 31 real logits
are the same on every rank and TP=1's but for rounding, so the model is correct.

  own_range   the padding masked by the rank that owns it (ranks' padded logits differ)
  every_rank  every rank masks every padding id (ranks' logits equal)

    tpdiag compare --model py:tests/models/planted/gathered_pad.py:own_range --tp 1,2
tests/test_gathered_pad.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ, DIVISIBLE_BY = 31, 32, 2, 8, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def padded_vocab(tp):
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB // multiple) * multiple


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Gather(torch.autograd.Function):
    """All-gather of the last dim; backward keeps this rank's columns of the (replicated) grad."""

    @staticmethod
    def forward(ctx, y):
        r, n = rank_world()
        ctx.r, ctx.per = r, y.shape[-1]
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.per:(ctx.r + 1) * ctx.per].contiguous()


class GatheredHead(nn.Module):
    def __init__(self, own_range):
        super().__init__()
        r, n = rank_world()
        self.per = padded_vocab(n) // n
        master = torch.cat([torch.randn(VOCAB, DIM) / DIM ** 0.5, torch.zeros(self.per * n - VOCAB, DIM)])
        self.weight = nn.Parameter(master[r * self.per:(r + 1) * self.per].clone())
        self.own_range = own_range

    def forward(self, x):
        r, n = rank_world()
        y = (_Copy.apply(x) if n > 1 else x) @ self.weight.t()
        z = _Gather.apply(y) if n > 1 else y
        ids = torch.arange(z.shape[-1], device=z.device)
        pad = ids >= VOCAB
        if self.own_range:  # only the padding ids of this rank's range
            pad = pad & (ids >= r * self.per) & (ids < (r + 1) * self.per)
        return z.masked_fill(pad, float("-inf"))


class LM(nn.Module):
    def __init__(self, own_range):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = GatheredHead(own_range)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def _target(own_range):
    return tpdiag.Target(model=LM(own_range), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def own_range():
    return _target(True)


def every_rank():
    return _target(False)
