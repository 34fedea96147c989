"""A user's model with a sparse token embedding (`nn.Embedding(sparse=True)`: its weight grad a
sparse COO tensor), an MLP column/row-parallel by the plan:

  target     the embedding replicated on every rank
  rows_ok    its vocab rows cut by hand as Megatron's VocabParallelEmbedding cuts them (each rank
             keeps its own rows as a plain parameter, reads zeros for other tokens, the ranks'
             outputs summed forward, the grad passed through backward)
  rows_sum   the same, the outputs summed with torch.distributed.nn.functional.all_reduce, whose
             backward all-reduces the grad too: each rank's sparse grad is TP times its rows'

    tpdiag compare --model py:tests/models/sparse_embed.py:rows_sum --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

VOCAB, DIM, HIDDEN = 32, 16, 32


def world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _SumForward(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class VocabRows(nn.Module):
    def __init__(self, full: torch.Tensor, both_ways: bool):
        super().__init__()
        r, n = world()
        k = full.shape[0] // n
        self.lo, self.hi, self.both_ways = r * k, r * k + k, both_ways
        self.weight = nn.Parameter(full[self.lo:self.hi].clone())

    def forward(self, ids):
        if world()[1] == 1:
            return F.embedding(ids, self.weight, sparse=True)
        out = (ids < self.lo) | (ids >= self.hi)
        h = F.embedding((ids - self.lo).masked_fill(out, 0), self.weight, sparse=True).masked_fill(out[..., None], 0.0)
        if self.both_ways:
            from torch.distributed.nn.functional import all_reduce

            return all_reduce(h)
        return _SumForward.apply(h)


class LM(nn.Module):
    def __init__(self, rows: str | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=True)
        if rows:
            self.embed = VocabRows(self.embed.weight.detach(), both_ways=rows == "sum")
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def _target(rows=None):
    return tpdiag.Target(model=LM(rows), plan={"up": ColwiseParallel(), "down": RowwiseParallel()}, vocab_size=VOCAB)


def target():
    return _target()


def rows_ok():
    return _target("ok")


def rows_sum():
    return _target("sum")
