"""Activation checkpointing around a tensor-parallel MLP, as a user turns it on to save memory
(helper hbug11): `torch.utils.checkpoint` (reentrant: the old default, Megatron's own
`tensor_parallel.checkpoint` works the same way - the block's forward is run again during
backward, under grad, and that recompute's graph is the one differentiated). Vocab 32, hidden 32.

  ckpt_ok          a DTensor plan (ColwiseParallel up, RowwiseParallel down) with the MLP
                   checkpointed (use_reentrant=True)
  ckpt_ok_nr       the same, use_reentrant=False
  ckpt_bias        Megatron's layers by hand (each rank slices its columns / rows of the whole
                   weights), the MLP checkpointed (use_reentrant=True), the row-parallel layer
                   adding its bias on every rank before the all-reduce (TP times the bias)
  ckpt_dgrad       the same layers, the bias right, but the column layer's f forgets its backward
                   all-reduce (the forward exact; the input grad each rank's share)
  ckpt_bias_ok     the twin of both: the bias added once, after the all-reduce

    tpdiag compare --model py:tests/models/planted/act_ckpt.py:ckpt_ok --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _NoReduce(torch.autograd.Function):
    """f with its backward all-reduce forgotten: each rank's input grad is its columns' share."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, the input grad all-reduced in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


def _tp():
    return rank_world()[1] > 1


def sum_grad(p):
    """Each rank holds the whole parameter and uses its slice: the ranks' grads summed."""
    def hook(g):
        if _tp():
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class PlannedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class HandMLP(nn.Module):
    def __init__(self, bias_every_rank: bool, dgrad_reduced: bool = True):
        super().__init__()
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(DIM))
        self.bias_every_rank = bias_every_rank
        self.f = _Copy if dgrad_reduced else _NoReduce
        sum_grad(self.up)
        sum_grad(self.down)

    def forward(self, x):
        r, n = rank_world()
        cols = slice(r * HIDDEN // n, (r + 1) * HIDDEN // n)
        h = F.gelu((self.f.apply(x) if _tp() else x) @ self.up[cols].t())
        y = h @ self.down[:, cols].t()
        if self.bias_every_rank:  # the mistake: before the all-reduce, on every rank
            y = y + self.bias
            return _Reduce.apply(y) if _tp() else y
        return (_Reduce.apply(y) if _tp() else y) + self.bias


class LM(nn.Module):
    def __init__(self, mlp, reentrant: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = mlp
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.reentrant = reentrant

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + checkpoint(self.mlp, h, use_reentrant=self.reentrant)
        return self.head(self.norm(h))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _planned(reentrant):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LM(PlannedMLP(), reentrant), vocab_size=VOCAB, inputs=_tokens,
                         plan={"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})


def ckpt_ok():
    return _planned(True)


def ckpt_ok_nr():
    return _planned(False)


def ckpt_bias():
    return tpdiag.Target(model=LM(HandMLP(True), True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def ckpt_dgrad():
    return tpdiag.Target(model=LM(HandMLP(False, False), True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def ckpt_bias_ok():
    return tpdiag.Target(model=LM(HandMLP(False), True), plan={}, vocab_size=VOCAB, inputs=_tokens)
