"""How each rank gets its shard of a hand-written Megatron-style TP MLP (helper hplant18): rank r
holds rows [r FF/n, (r+1) FF/n) of `up` and those columns of `down`. Vocab 32, dim 32, ffn 64.

  draw_shard   each rank draws only its shard, `torch.randn(FF // n, DIM)` - tpdiag (as a launcher
               does) seeds every rank alike, so every rank draws the SAME values: rank 1 holds a
               copy of rank 0's rows, not rows 32..63 of the weight TP=1 draws. The TP=2 model is
               another model.                                                             BUG
  cut_master   the master drawn whole on every rank and cut (Megatron's CPU init).        rounding

    tpdiag compare --model py:tests/models/planted/init_shard.py:draw_shard --tp 1,2
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


class MLP(nn.Module):
    def __init__(self, draw_own):
        super().__init__()
        r, n = rank_world()
        per = FFN // n
        if draw_own:
            up = torch.randn(per, DIM) / DIM ** 0.5
            down = torch.randn(DIM, per) / FFN ** 0.5
        else:
            up = (torch.randn(FFN, DIM) / DIM ** 0.5)[r * per:(r + 1) * per]
            down = (torch.randn(DIM, FFN) / FFN ** 0.5)[:, r * per:(r + 1) * per]
        self.up = nn.Parameter(up.clone())
        self.down = nn.Parameter(down.clone())

    def forward(self, x):
        n = rank_world()[1]
        y = F.linear(F.gelu(F.linear(_Copy.apply(x) if n > 1 else x, self.up)), self.down)
        return _Reduce.apply(y) if n > 1 else y


class LM(nn.Module):
    def __init__(self, draw_own):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(draw_own)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(self.norm(x + self.mlp(x)))


def _target(draw_own):
    return tpdiag.Target(model=LM(draw_own), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def draw_shard():
    return _target(True)


def cut_master():
    return _target(False)
