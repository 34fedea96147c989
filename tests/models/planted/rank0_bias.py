"""vLLM's RowParallelLinear bias, written by hand (helper hbug9): the row-parallel projection's bias
is held whole on every rank and added by rank 0 only, before the all-reduce (`bias_ = None if
tp_rank > 0 else self.bias`), so the sum holds it once. Each rank holds only its shard of `up` and
`down` (sliced from a master drawn whole). Vocab 32, hidden 32, seq 8.

  rank0_bias   as vLLM writes it. Forward (an engine's use): correct - (x0 + b) + x1 against TP=1's
               x0 + x1 + b, another rounding of the same sum. Trained, the bias's grad reaches rank 0
               only: rank 1's replica never moves (a real mistake in a trainer).
  bias_after   the twin a trainer needs: the bias added after the all-reduce, on every rank.

    tpdiag compare --model py:tests/models/planted/rank0_bias.py:rank0_bias --tp 1,2 --forward-only
tests/test_rank0_bias.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


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
    def __init__(self, rank0):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))
        self.bias = nn.Parameter(torch.randn(DIM))
        self.rank0 = rank0

    def forward(self, x):
        r, n = rank_world()
        h = F.gelu((_Copy.apply(x) if n > 1 else x) @ self.up.t())
        if n == 1:
            return F.linear(h, self.down, self.bias)
        if self.rank0:
            y = F.linear(h, self.down, self.bias if r == 0 else None)
            return _Reduce.apply(y)
        return _Reduce.apply(F.linear(h, self.down)) + self.bias


class LM(nn.Module):
    def __init__(self, rank0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(rank0)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(self.norm(x + self.mlp(x)))


def _target(rank0):
    return tpdiag.Target(model=LM(rank0), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def rank0_bias():
    return _target(True)


def bias_after():
    return _target(False)
