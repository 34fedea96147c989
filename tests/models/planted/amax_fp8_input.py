"""FP8 activations with delayed scaling, written by hand on a tensor-parallel MLP (helper hleft11):
the MLP casts its input to float8 (e5m2) and back before its column-parallel `up` layer, which
fake-quantises its output to 8-bit steps of the amax its previous training forward saw (a BUFFER
kept across steps, as Transformer Engine keeps its amax history). Each rank holds only its SHARD of
`up` / `down`; the amax of a column shard is the shard's, so the ranks must reduce it - with MAX -
to use TP=1's scale. Vocab 32, hidden 32.

  amax_sum  the mistake: the amax all-reduced with SUM (the default op): every rank keeps the sum
            of the shards' amaxes (about twice TP=1's), the replicas agree
  amax_max  the twin: all-reduced with MAX (bitwise TP=1's amax)

    tpdiag compare --model py:tests/models/planted/amax_fp8_input.py:amax_sum --tp 1,2 --steps 2
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


def shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


class CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class StraightThrough(torch.autograd.Function):
    """y rounded to 127 steps of amax; the grad passes as is"""

    @staticmethod
    def forward(ctx, y, amax):
        step = amax / 127
        return torch.round(y / step).clamp(-127, 127) * step

    @staticmethod
    def backward(ctx, g):
        return g, None


class ScaledUp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.weight = nn.Parameter(shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.register_buffer("amax", torch.ones(()))
        self.op = op

    def forward(self, x):
        n = rank_world()[1]
        y = (CopyToRanks.apply(x) if n > 1 else x) @ self.weight.t()
        out = StraightThrough.apply(y, self.amax)
        if self.training:
            with torch.no_grad():
                seen = y.abs().amax()
                if n > 1:
                    dist.all_reduce(seen, op=self.op)
                self.amax.copy_(seen)
        return out


class FP8MLP(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.up = ScaledUp(op)
        self.down = nn.Parameter(shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))

    def forward(self, x):
        n = rank_world()[1]
        x8 = x.to(torch.float8_e5m2).to(x.dtype)  # the activations as an FP8 GEMM reads them
        y = F.gelu(self.up(x8)) @ self.down.t()
        return x + (SumOverRanks.apply(y) if n > 1 else y)


class LM(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = FP8MLP(op)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def make(op):
    return tpdiag.Target(model=LM(op), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def amax_sum():
    return make(dist.ReduceOp.SUM)


def amax_max():
    return make(dist.ReduceOp.MAX)
