"""Delayed FP8 scaling written by hand, then a hand-written column-parallel projection (helper
hbug13). An `observer` keeps the amax of the embedding output in a BUFFER for the next step's
scale; each rank looks at its own share of the tokens (as under sequence parallelism), and the
MAX all-reduce that makes them one amax is forgotten: the ranks keep different amaxes. Nothing
reads it in this step. After it,
`proj` - a column-parallel layer and its GELU, the ranks' output columns gathered - is written
with the gather's pieces put together in the wrong order.

  swapped  both mistakes: the amax (per rank) and proj's gather in reversed rank order
  amax_only  the amax mistake; proj gathers in rank order (correct)

    tpdiag compare --model py:tests/models/planted/amax_then_bug.py:swapped --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, OUT, BATCH, SEQ = 32, 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class AmaxObserver(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("amax", torch.ones(()))

    def forward(self, x):
        r, n = rank_world()
        with torch.no_grad():
            share = x.shape[1] // n
            self.amax.copy_(x[:, r * share:(r + 1) * share].abs().amax())
        return x


class _Gather(torch.autograd.Function):
    """all-gather each rank's columns along the last dim; backward keeps this rank's slice"""

    @staticmethod
    def forward(ctx, y, reverse):
        r, n = rank_world()
        ctx.r, ctx.w = r, y.shape[-1]
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        if reverse:
            parts = parts[::-1]
            ctx.r = n - 1 - r
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.w:(ctx.r + 1) * ctx.w].contiguous(), None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class ColumnProj(nn.Module):
    def __init__(self, reverse):
        super().__init__()
        r, n = rank_world()
        full = torch.randn(OUT, DIM) / DIM ** 0.5
        self.weight = nn.Parameter(full.narrow(0, r * (OUT // n), OUT // n).clone())
        self.reverse = reverse

    def forward(self, x):
        if rank_world()[1] == 1:
            return F.gelu(x @ self.weight.t())
        return F.gelu(_Gather.apply(_Copy.apply(x) @ self.weight.t(), self.reverse))


class LM(nn.Module):
    def __init__(self, reverse):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.observer = AmaxObserver()
        self.proj = ColumnProj(reverse)
        self.norm = nn.LayerNorm(OUT)
        self.head = nn.Linear(OUT, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.proj(self.observer(self.embed(tokens)))))


def _target(reverse):
    return tpdiag.Target(model=LM(reverse), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def swapped():
    return _target(True)


def amax_only():
    return _target(False)
