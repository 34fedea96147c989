"""A hand-written row-parallel layer whose rank partials cancel (helper hbug13): no plan - the
user's own `RowParallel` keeps its slice of the weight's input columns, runs F.linear on its slice
of the (replicated) input and all-reduces the partial outputs itself. `down` reads the hidden twice
(`cat([h, h])`) with weights [K a, -K a + b] (K = 30): in bf16 each rank's partial, 30x the output,
is rounded before the all-reduce - a rounding TP=1's one GEMM never makes.

  cancel_hand       the block above (correct at every TP: rounding only)
  cancel_hand_bias  the same, and beside `down` a second RowParallel `proj` of the block's input,
                    whose bias every rank adds before the all-reduce (N times at TP=N: a bug)

    tpdiag compare --model py:tests/models/planted/cancel_handwritten.py:cancel_hand --tp 1,2 --dtype bfloat16
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 32, 64, 2, 8
K = 30.0


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Gather(torch.autograd.Function):
    """the input's grad: each rank's grad covers its own columns; all-gathered back to full"""

    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.lo, ctx.hi, ctx.k = lo, hi, x.shape[-1]
        return x[..., lo:hi]

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(rank_world()[1])]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, -1), None, None


class RowParallel(nn.Module):
    """y = x W^T (+ b), W's input columns split over the ranks, the partials all-reduced."""

    def __init__(self, full_weight, bias=None):
        super().__init__()
        r, n = rank_world()
        k = full_weight.shape[1] // n
        self.lo, self.hi = r * k, (r + 1) * k
        self.weight = nn.Parameter(full_weight[:, self.lo:self.hi].clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None

    def forward(self, x):
        if rank_world()[1] == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(_Gather.apply(x, self.lo, self.hi), self.weight, self.bias)  # bias on every rank
        return _AllReduce.apply(y)


class Block(nn.Module):
    def __init__(self, with_proj):
        super().__init__()
        self.up = nn.Linear(DIM, FF // 2, bias=False)
        a = torch.randn(DIM, FF // 2) / FF ** 0.5
        self.down = RowParallel(torch.cat([K * a, -K * a + torch.randn(DIM, FF // 2) / FF ** 0.5], 1))
        self.proj = RowParallel(torch.randn(DIM, DIM) / DIM ** 0.5, torch.randn(DIM)) if with_proj else None

    def forward(self, x):
        h = torch.relu(self.up(x))
        y = self.down(torch.cat([h, h], -1))
        return y + self.proj(x) if self.proj is not None else y


class LM(nn.Module):
    def __init__(self, with_proj):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(with_proj)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.block(h)))


def _target(with_proj):
    return tpdiag.Target(model=LM(with_proj), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def cancel_hand():
    return _target(False)


def cancel_hand_bias():
    return _target(True)
