"""FP8-style CURRENT scaling written by hand on a tensor-parallel MLP (helper hleft11): an `observer`
module takes the amax of the column-parallel output and keeps it in a BUFFER; the `quant` module next
to it, given the observer at construction (as Transformer Engine's quantizers share their scaling
state), fake-quantises that same output with the amax just written - the buffer is written and read
in the same forward. Each rank holds only its SHARD of `up` / `down`, so the ranks must reduce the
amax - with MAX - to use TP=1's scale.

  amax_sum  the mistake: the amax all-reduced with SUM; `quant` then reads a wrong scale
  amax_max  the twin: all-reduced with MAX (bitwise TP=1's amax)

    tpdiag compare --model py:tests/models/planted/amax_current.py:amax_sum --tp 1,2
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


class _FakeQuant(torch.autograd.Function):
    """round to 127 steps of amax (straight-through backward)"""

    @staticmethod
    def forward(ctx, y, amax):
        step = amax / 127
        return torch.round(y / step).clamp(-127, 127) * step

    @staticmethod
    def backward(ctx, g):
        return g, None


class Observer(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.register_buffer("amax", torch.ones(()))
        self.op = op

    def forward(self, y):
        with torch.no_grad():
            seen = y.abs().amax()
            if rank_world()[1] > 1:
                dist.all_reduce(seen, op=self.op)
            self.amax.copy_(seen)
        return y


class Quant(nn.Module):
    def __init__(self, observer):
        super().__init__()
        self.scaling = [observer]  # shared scaling state, not a submodule of its own

    def forward(self, y):
        return _FakeQuant.apply(y, self.scaling[0].amax)


class MLP(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.observer = Observer(op)
        self.quant = Quant(self.observer)
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))

    def forward(self, x):
        n = rank_world()[1]
        y = (_Copy.apply(x) if n > 1 else x) @ self.up.t()
        y = self.quant(self.observer(y))
        y = F.gelu(y) @ self.down.t()
        return x + (_Reduce.apply(y) if n > 1 else y)


class LM(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(op)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _target(op):
    return tpdiag.Target(model=LM(op), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def amax_sum():
    return _target(dist.ReduceOp.SUM)


def amax_max():
    return _target(dist.ReduceOp.MAX)
