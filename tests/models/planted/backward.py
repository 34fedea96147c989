"""A mistake that lives only in the backward pass: every rank holds the whole weight of a
hand-rolled column-parallel layer and uses its slice, so each rank's weight grad covers its
slice and the ranks' grads must be SUMMED. `averaged()` averages them instead, as one would a
data-parallel grad (the TP group mistaken for a DP group): the forward, the loss and every
activation grad are right, the weight grad is 1/TP of the truth. `summed()` is its twin.
"""
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
from torch import nn

import tpdiag

VOCAB, DIM, OUT, BATCH, SEQ = 64, 64, 128, 2, 8
warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward; the input grad (each rank's slice's share) all-reduced."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _Gather(torch.autograd.Function):
    """All-gather of the last dim; backward keeps this rank's slice of the (replicated) grad."""

    @staticmethod
    def forward(ctx, y):
        r, n = rank_world()
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        ctx.r, ctx.m = r, y.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.m:(ctx.r + 1) * ctx.m].contiguous()


class ColumnGathered(nn.Module):
    def __init__(self, average: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(OUT, DIM) / DIM ** 0.5)
        self.weight.register_hook(self._sync)
        self.average = average

    def _sync(self, g):
        r, n = rank_world()
        if n == 1:
            return g
        g = dnn.all_reduce(g)
        return g / n if self.average else g

    def forward(self, x):
        r, n = rank_world()
        m = OUT // n
        if n == 1:
            return x @ self.weight.t()
        return _Gather.apply(_Copy.apply(x) @ self.weight[r * m:(r + 1) * m].t())


class LM(nn.Module):
    def __init__(self, average):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = ColumnGathered(average)
        self.head = nn.Linear(OUT, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(torch.relu(self.layer(self.embed(tokens))))


def _target(average):
    return tpdiag.Target(model=LM(average), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def summed():
    return _target(False)


def averaged():
    return _target(True)
