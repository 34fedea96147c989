"""A stage applied twice per step (a looped / weight-shared block, as ALBERT or a universal
transformer does), its MLP written by hand in Megatron's style: each rank holds the whole weights
and multiplies by its slice of them (`up` rows, `down` columns [r FF/n, (r+1) FF/n)), Megatron's f
in front and g behind. Vocab 32, dim 32, ff 64.

  loop_ok       correct at every TP                                                  rounding
  loop_bias     the block adds its bias on every rank before g's all-reduce: TP times at TP > 1,
                in both applications                                                 BUG

    tpdiag compare --model py:tests/models/planted/loop_stage.py:loop_ok --tp 1,2
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


class _Copy(torch.autograd.Function):
    """Megatron's f: the input as is, its grad all-reduced over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, y):
        y = y.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


def _summed(g):
    g = g.clone()
    dist.all_reduce(g)
    return g


class Block(nn.Module):
    """up column-parallel (this rank's rows of the weight), down row-parallel (its columns)."""

    def __init__(self, bias_each_rank: bool):
        super().__init__()
        self.up = nn.Parameter(torch.randn(FF, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, FF) / FF ** 0.5)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.bias_each_rank = bias_each_rank
        if rank_world()[1] > 1:
            # each rank used its slice of the whole weight: the ranks' grads summed
            for p in (self.up, self.down):
                p.register_hook(_summed)

    def forward(self, x):
        r, n = rank_world()
        rows = slice(r * FF // n, (r + 1) * FF // n)
        xin = _Copy.apply(x) if n > 1 else x
        y = F.gelu(xin @ self.up[rows].t()) @ self.down[:, rows].t()
        if self.bias_each_rank:
            y = y + self.bias  # the mistake: added by every rank, then summed
        y = _Reduce.apply(y) if n > 1 else y
        return y if self.bias_each_rank else y + self.bias


class Stage(nn.Module):
    def __init__(self, bias_each_rank: bool):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.block = Block(bias_each_rank)

    def forward(self, h):
        return h + self.block(self.norm(h))


class LoopLM(nn.Module):
    def __init__(self, bias_each_rank=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.stage = Stage(bias_each_rank)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for _ in range(2):  # one stage, its weights shared by both applications
            h = self.stage(h)
        return self.head(self.norm(h))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loop_ok():
    return tpdiag.Target(model=LoopLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def loop_bias():
    return tpdiag.Target(model=LoopLM(bias_each_rank=True), plan={}, vocab_size=VOCAB, inputs=_tokens)
