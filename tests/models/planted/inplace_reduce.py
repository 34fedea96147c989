"""Megatron's mappings copied as they are, in-place (helper hplant18): `_ReduceFromModelParallelRegion`
all-reduces the row-parallel GEMM's output IN PLACE and returns that same tensor (no clone), and the
MLP scales its activation in place (`h.mul_(1.5)`) - code written to save memory. Each rank holds
only its shards of `up` (rows) and `down` (columns), cut from masters drawn whole. Vocab 32, dim 32,
ffn 64, seq 8.

  inplace_ok    correct: the same function as TP=1, the row-parallel sum reordered.  rounding
  inplace_bias  `torch.addmm(bias, h, W.t())` - the bias fused into each rank's partial GEMM -
                then all-reduced in place: the bias counted TP times.              BUG

    tpdiag compare --model py:tests/models/planted/inplace_reduce.py:inplace_ok --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _reduce(input_):
    if rank_world()[1] == 1:
        return input_
    dist.all_reduce(input_)
    return input_


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class MLP(nn.Module):
    def __init__(self, fused_bias):
        super().__init__()
        r, n = rank_world()
        per = FFN // n
        self.up = nn.Parameter((torch.randn(FFN, DIM) / DIM ** 0.5)[r * per:(r + 1) * per].clone())
        self.down = nn.Parameter((torch.randn(DIM, FFN) / FFN ** 0.5)[:, r * per:(r + 1) * per].clone())
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.fused_bias = fused_bias

    def forward(self, x):
        h = F.linear(_CopyToModelParallelRegion.apply(x), self.up)
        h = F.gelu(h)
        h.mul_(1.5)
        if self.fused_bias:
            return _ReduceFromModelParallelRegion.apply(torch.addmm(self.bias, h.flatten(0, 1), self.down.t()).view(*h.shape[:2], -1))
        out = _ReduceFromModelParallelRegion.apply(F.linear(h, self.down))
        return out + self.bias


class LM(nn.Module):
    def __init__(self, fused_bias):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.mlp = MLP(fused_bias)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.mlp(self.ln(x))
        return self.head(self.norm(x))


def _target(fused_bias):
    return tpdiag.Target(model=LM(fused_bias), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def inplace_ok():
    return _target(False)


def inplace_bias():
    return _target(True)
