"""Megatron's ColumnParallelLinear with `gather_output=True`, its gather taken from
`torch.distributed.nn.functional.all_gather` ("the collective with autograd") - helper hred14. Each
rank keeps its rows of `up` (a master drawn whole); its input goes through Megatron's `f` (identity
forward, all-reduce backward); the gathered hidden feeds a replicated `down` and head. Vocab 32,
hidden 32, ffn 64.

  gather_autograd  torch's all_gather backward reduce-scatters the grads of the gathered pieces -
                   right when each rank's consumer saw only its own piece, but here every rank runs
                   the same replicated `down` on the whole hidden, so every rank already holds the
                   whole grad and the sum makes it TP times too big: the forward exact, `up`'s
                   grads (and through `f` the embedding's share from it) 2x at TP=2.
  gather_slice     the twin: Megatron's own _GatherFromModelParallelRegion - all-gather forward,
                   backward keeps this rank's columns of the (replicated) grad.

    tpdiag compare --model py:tests/models/planted/autograd_gather.py:gather_autograd --tp 1,2
"""
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)

VOCAB, DIM, FFN, BATCH, SEQ = 32, 32, 64, 2, 8


def tp_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        r, n = tp_world()
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        ctx.r, ctx.width = r, y.shape[-1]
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.width:(ctx.r + 1) * ctx.width].contiguous()


class ColumnParallelLinear(nn.Module):
    def __init__(self, autograd_gather):
        super().__init__()
        r, n = tp_world()
        master = torch.randn(FFN, DIM) / DIM ** 0.5
        per = FFN // n
        self.weight = nn.Parameter(master[r * per:(r + 1) * per].clone())
        self.autograd_gather = autograd_gather

    def forward(self, x):
        if tp_world()[1] == 1:
            return F.linear(x, self.weight)
        y = F.linear(_CopyToRegion.apply(x), self.weight)
        if self.autograd_gather:
            from torch.distributed.nn.functional import all_gather

            return torch.cat(all_gather(y), -1)
        return _GatherFromRegion.apply(y)


class LM(nn.Module):
    def __init__(self, autograd_gather):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = ColumnParallelLinear(autograd_gather)
        self.down = nn.Linear(FFN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.down(F.gelu(self.up(h))))


def _target(autograd_gather):
    return tpdiag.Target(model=LM(autograd_gather), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def gather_autograd():
    return _target(True)


def gather_slice():
    return _target(False)
