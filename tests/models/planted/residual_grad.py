"""Residual blocks `h = h + blk(h)` written by hand (helper hbug13c): the add sits in the model's
forward, outside any module, so the embedding's output feeds two consumers - the block and the
residual add - and its grad is the sum of the block's input grad and the grad that flows straight
through the add. Each block is a hand-written column-parallel `up` that reads the block's input
itself (its own rows of the weight, its input grad all-reduced), a GELU, and a hand-written
row-parallel `down` (its own input columns, its output all-reduced).

  residual_ok       correct at every TP: rounding only
  residual_no_reduce  `up`'s input-grad all-reduce forgotten (each rank keeps its own share: a bug)
  residual_doubled  `up`'s input grad all-reduced and then added to itself again (a bug)
  gathered_ok       `up`'s output columns all-gathered and `down` replicated: the forward is TP=1's
                    bit for bit, and the first divergence is the embedding's grad (rounding only)
  gathered_doubled  the same with `up`'s input grad doubled (a bug)

    tpdiag compare --model py:tests/models/planted/residual_grad.py:residual_no_reduce --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _CopyIn(torch.autograd.Function):
    """the input as is; its grad, each rank's partial over its own output rows, summed over ranks"""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        if ctx.mode != "forget":
            dist.all_reduce(g)
        if ctx.mode == "double":
            g = g + g
        return g, None


class _SumOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        y = y.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


class _Gather(torch.autograd.Function):
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


class ColumnIn(nn.Module):
    """y_r = x W_r^T: this rank's rows of W (its share of the hidden units); gather: all of them."""

    def __init__(self, full_weight, mode, gather=False):
        super().__init__()
        r, n = rank_world()
        k = full_weight.shape[0] // n
        self.weight = nn.Parameter(full_weight[r * k:(r + 1) * k].clone())
        self.mode, self.gather = mode, gather

    def forward(self, x):
        if rank_world()[1] == 1:
            return F.linear(x, self.weight)
        y = F.linear(_CopyIn.apply(x, self.mode), self.weight)
        return _Gather.apply(y) if self.gather else y


class RowOut(nn.Module):
    """y = sum_r h_r W_r^T: this rank's input columns of W, the partials all-reduced."""

    def __init__(self, full_weight):
        super().__init__()
        r, n = rank_world()
        k = full_weight.shape[1] // n
        self.weight = nn.Parameter(full_weight[:, r * k:(r + 1) * k].clone())

    def forward(self, h):
        y = F.linear(h, self.weight)
        return y if rank_world()[1] == 1 else _SumOut.apply(y)


class MLP(nn.Module):
    def __init__(self, mode, gather):
        super().__init__()
        self.up = ColumnIn(torch.randn(FF, DIM) / DIM ** 0.5, mode, gather)
        down = torch.randn(DIM, FF) / FF ** 0.5
        self.down = nn.Linear(FF, DIM, bias=False) if gather else RowOut(down)
        if gather:
            self.down.weight.data.copy_(down)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    def __init__(self, mode, gather):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(mode, gather)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.mlp(h)
        return self.head(self.norm(h))


def _target(mode, gather=False):
    return tpdiag.Target(model=LM(mode, gather), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def residual_ok():
    return _target("reduce")


def residual_no_reduce():
    return _target("forget")


def residual_doubled():
    return _target("double")


def gathered_ok():
    return _target("reduce", True)


def gathered_doubled():
    return _target("double", True)
