"""A hand-written row-parallel layer whose rank partials cancel (helper hbug13): no plan - the
user's own `RowParallel` keeps its slice of the weight's input columns, runs F.linear on its slice
of the (replicated) input and all-reduces the partial outputs itself. `down` reads the hidden twice
(`cat([h, h])`) with weights [K a, -K a + b] (K = 30): in bf16 each rank's partial, 30x the output,
is rounded before the all-reduce - a rounding TP=1's one GEMM never makes.

  cancel_hand       the block above (correct at every TP: rounding only)
  cancel_hand_bias  the same, and beside `down` a second RowParallel `proj` of the block's input,
                    whose bias every rank adds before the all-reduce (N times at TP=N: a bug)
  cancel_col        the backward mirror: a hand-written ColumnParallel `up` (its own rows of the
                    weight, its output columns all-gathered, its input grad all-reduced) whose two
                    halves of rows [K a; -K a + b] the block adds: each rank's bf16 share of the
                    input grad, 30x the sum, is rounded before the all-reduce (correct: rounding)
  cancel_col_bug    the same, then a second such block, `block2`, of plain weights whose input
                    grad's all-reduce is forgotten (each rank keeps its own share: a bug)

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


class _CopyToRanks(torch.autograd.Function):
    """the input as is; its grad, each rank's partial over its own output columns, all-reduced"""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _NoReduce(torch.autograd.Function):
    """the mistake: the input grad's all-reduce forgotten"""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        r, n = rank_world()
        ctx.r, ctx.w = r, y.shape[-1]
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.w:(ctx.r + 1) * ctx.w].contiguous()


class ColumnParallel(nn.Module):
    """y = x W^T, W's output rows split over the ranks, the outputs all-gathered."""

    def __init__(self, full_weight, reduce=True):
        super().__init__()
        r, n = rank_world()
        k = full_weight.shape[0] // n
        self.weight = nn.Parameter(full_weight[r * k:(r + 1) * k].clone())
        self.copy = _CopyToRanks if reduce else _NoReduce

    def forward(self, x):
        if rank_world()[1] == 1:
            return F.linear(x, self.weight)
        return _GatherColumns.apply(F.linear(self.copy.apply(x), self.weight))


class ColBlock(nn.Module):
    def __init__(self, k=K, reduce=True):
        super().__init__()
        a = torch.randn(FF // 2, DIM) / DIM ** 0.5
        self.up = ColumnParallel(torch.cat([k * a, -k * a + torch.randn(FF // 2, DIM) / DIM ** 0.5], 0), reduce)

    def forward(self, x):
        z = self.up(x)
        return z[..., :FF // 2] + z[..., FF // 2:]


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
    def __init__(self, with_proj, col_bug=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(with_proj) if with_proj is not None else ColBlock()
        self.block2 = ColBlock(1.0, reduce=False) if col_bug else None
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.block2 is not None:
            return self.head(self.norm(self.block2(self.block(h))))
        if isinstance(self.block, ColBlock):  # no residual: the embedding's grad is the block's alone
            return self.head(self.norm(self.block(h)))
        return self.head(self.norm(h + self.block(h)))


def _target(with_proj, col_bug=False):
    return tpdiag.Target(model=LM(with_proj, col_bug), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def cancel_hand():
    return _target(False)


def cancel_hand_bias():
    return _target(True)


def cancel_col():
    return _target(None)


def cancel_col_bug():
    return _target(None, True)
