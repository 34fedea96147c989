"""Megatron's split row-parallel layer (helper hbug14): `RowParallelLinear(..., input_is_parallel=True,
skip_bias_add=True)` with its all-reduce left to the caller (Megatron-Core's `reduce_results=False`,
the all-reduce done by a module of its own, as a fused MoE/shared-expert path or a user's
`ReduceFromTP` does): the row layer returns this rank's PARTIAL sum and its bias unadded, a separate
module all-reduces the partials, the MLP adds the bias once. Each rank holds only its shards of the
weights (sliced from a master weight drawn whole, as Megatron's CPU init does). Vocab 32, hidden 32.

  split_ok         the partials reduced by ReduceFromTP, the bias added after it.       rounding
  split_bias_rank  the bias added to each rank's partial before the reduce: TP times.   BUG
  split_noreduce   the reduce forgotten: each rank goes on with its own partial.        BUG

    tpdiag compare --model py:tests/models/planted/mega_split.py:split_ok --tp 1,2
tests/test_mega_split.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _ColumnFn(torch.autograd.Function):
    """y = x W^T + b on this rank's output columns; backward sums the ranks' input grads."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = g @ w
        if rank_world()[1] > 1:
            dist.all_reduce(dx)
        dw = g.flatten(0, -2).t() @ x.flatten(0, -2)
        return dx, dw, g.flatten(0, -2).sum(0)


class ColumnParallelLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        r, n = rank_world()
        rows = slice(r * d_out // n, (r + 1) * d_out // n)
        master = torch.randn(d_out, d_in) / d_in ** 0.5  # the same draw on every rank
        self.weight = nn.Parameter(master[rows].clone())
        self.bias = nn.Parameter(torch.zeros(d_out)[rows].clone() + 0.1)

    def forward(self, x):
        return _ColumnFn.apply(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """input_is_parallel=True, skip_bias_add=True, reduce_results=False: (x_r W_r^T, bias)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        r, n = rank_world()
        cols = slice(r * d_in // n, (r + 1) * d_in // n)
        master = torch.randn(d_out, d_in) / d_in ** 0.5
        self.weight = nn.Parameter(master[:, cols].clone())
        self.bias = nn.Parameter(torch.full((d_out,), 0.1))

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class ReduceFromTP(nn.Module):
    def forward(self, t):
        return _Reduce.apply(t) if rank_world()[1] > 1 else t


class SplitMLP(nn.Module):
    def __init__(self, mistake=None):
        super().__init__()
        self.up = ColumnParallelLinear(DIM, HIDDEN)
        self.down = RowParallelLinear(HIDDEN, DIM)
        self.reduce = ReduceFromTP()
        self.mistake = mistake

    def forward(self, x):
        partial, bias = self.down(F.gelu(self.up(x)))
        if self.mistake == "bias_rank":  # every rank's partial carries the whole bias
            return x + self.reduce(partial + bias)
        if self.mistake == "noreduce":  # the caller forgot the reduce the layer left to it
            return x + partial + bias
        return x + self.reduce(partial) + bias


class SplitLM(nn.Module):
    def __init__(self, mistake=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = SplitMLP(mistake)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def split_ok():
    return tpdiag.Target(model=SplitLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def split_bias_rank():
    return tpdiag.Target(model=SplitLM("bias_rank"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def split_noreduce():
    return tpdiag.Target(model=SplitLM("noreduce"), plan={}, vocab_size=VOCAB, inputs=_tokens)
