"""A user's hand-rolled tensor-parallel layers (plain torch.distributed, every rank holding the
full weights and slicing its share), each with the mistake people make writing it. `bug=False`
is the correct layer; `bug=True` the planted mistake. tpdiag has no layout for any of them:
its verdict must come from first principles (tests/test_planted.py).

  ShardNorm        LayerNorm of a column-parallel output: statistics over the whole width
                   (all-reduced sums) / bug: over the local shard only
  ShardSoftmax     softmax over a column-parallel output / bug: over the local shard
  RowBias          row-parallel linear / bug: bias added on every rank before the all-reduce
  RowReduce        row-parallel linear / bug: the partial sums all-reduced twice
  RowNoReduce      row-parallel linear / bug: the all-reduce forgotten (each rank keeps its partial)
  MeanFeatures     mean over a sharded feature dim / bug: divided by the local width
  GQAttention      grouped-query attention split by heads / bug: local q head i reads kv head
                   i // group of the GLOBAL numbering (wrong kv heads on every rank but 0)
  RopeAttention    rotary attention split by heads / bug: query positions offset by rank * seq
  SeqParallel      sequence-parallel MLP, chunks all-gathered along the sequence / bug: the
                   chunks concatenated in reverse rank order
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_last(y):
    r, n = rank_world()
    if n == 1:
        return y
    parts = [torch.empty_like(y) for _ in range(n)]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=-1)


def all_sum(t):
    if rank_world()[1] > 1:
        dist.all_reduce(t)
    return t


class ColumnPart(nn.Module):
    """x W[rank's rows]^T: this rank's output columns."""

    def __init__(self, din, dout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / din ** 0.5)
        self.bias = nn.Parameter(torch.randn(dout) * 0.5)

    def forward(self, x):
        r, n = rank_world()
        m = self.weight.shape[0] // n
        return x @ self.weight[r * m:(r + 1) * m].t() + self.bias[r * m:(r + 1) * m]


class OnColumns(nn.Module):
    """A column-parallel projection, then something over its (sharded) output features."""

    def __init__(self, dim, bug):
        super().__init__()
        self.proj = ColumnPart(dim, dim)
        self.bug = bug


class ShardNorm(OnColumns):
    def forward(self, x):
        y = self.proj(x)
        if self.bug:
            y = F.layer_norm(y, y.shape[-1:])
        else:
            width = y.shape[-1] * rank_world()[1]
            s = all_sum(y.sum(-1, keepdim=True))
            mean = s / width
            var = all_sum(((y - mean) ** 2).sum(-1, keepdim=True)) / width
            y = (y - mean) * torch.rsqrt(var + 1e-5)
        return gather_last(y)


class ShardSoftmax(OnColumns):
    def forward(self, x):
        y = self.proj(x)
        if self.bug:
            p = torch.softmax(y, dim=-1)
        else:
            m = y.amax(-1, keepdim=True)
            if rank_world()[1] > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
            e = torch.exp(y - m)
            p = e / all_sum(e.sum(-1, keepdim=True))
        return gather_last(p)


class RowLinear(nn.Module):
    """Row-parallel: each rank multiplies its slice of the input features."""

    def __init__(self, din, dout, mode):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / din ** 0.5)
        self.bias = nn.Parameter(torch.randn(dout) * 0.5)
        self.mode = mode

    def forward(self, x):
        r, n = rank_world()
        k = x.shape[-1] // n
        y = x[..., r * k:(r + 1) * k] @ self.weight[:, r * k:(r + 1) * k].t()
        if self.mode == "bias-every-rank":
            return all_sum(y + self.bias)
        if self.mode == "twice":
            return all_sum(all_sum(y)) + self.bias
        if self.mode == "forgotten":
            return y + self.bias
        return all_sum(y) + self.bias


class MeanFeatures(OnColumns):
    """Centre the features by their mean, the mean taken over a column-parallel output."""

    def forward(self, x):
        y = self.proj(x)
        width = y.shape[-1] if self.bug else y.shape[-1] * rank_world()[1]
        mean = all_sum(y.sum(-1, keepdim=True)) / width
        return gather_last(y - mean)


def rope(x, pos):
    """Rotary embedding of x [B, H, S, D] at integer positions pos [S]."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class HeadAttention(nn.Module):
    """Causal attention split by heads: rank r computes heads [r*H/N, (r+1)*H/N) and the head
    outputs are all-gathered. kv_heads < heads: grouped-query attention."""

    def __init__(self, dim, heads, kv_heads, bug=None):
        super().__init__()
        self.h, self.g, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Parameter(torch.randn(heads * self.d, dim) / dim ** 0.5)
        self.wk = nn.Parameter(torch.randn(kv_heads * self.d, dim) / dim ** 0.5)
        self.wv = nn.Parameter(torch.randn(kv_heads * self.d, dim) / dim ** 0.5)
        self.bug = bug

    def forward(self, x):
        r, n = rank_world()
        b, s, _ = x.shape
        hl, gl, d = self.h // n, self.g // n, self.d
        q = (x @ self.wq[r * hl * d:(r + 1) * hl * d].t()).view(b, s, hl, d).transpose(1, 2)
        if self.bug == "gqa":
            # the mistake: the local slice of kv heads taken as if it started at kv head 0
            kv = slice(0, gl * d)
        else:
            kv = slice(r * gl * d, (r + 1) * gl * d)
        k = (x @ self.wk[kv].t()).view(b, s, gl, d).transpose(1, 2)
        v = (x @ self.wv[kv].t()).view(b, s, gl, d).transpose(1, 2)
        pos = torch.arange(s)
        # the mistake: query positions offset as if this rank held sequence chunk r (the same
        # offset on q AND k would be harmless: rotary attention sees only position differences)
        q, k = rope(q, pos + (r * s if self.bug == "rope" else 0)), rope(k, pos)
        k = k.repeat_interleave(hl // gl, dim=1)
        v = v.repeat_interleave(hl // gl, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(att, dim=-1) @ v
        return gather_last(o.transpose(1, 2).reshape(b, s, hl * d))


class SeqParallel(nn.Module):
    """Sequence parallelism: rank r transforms its chunk of the sequence, the chunks are
    all-gathered back along the sequence."""

    def __init__(self, dim, bug):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bug = bug

    def forward(self, x):
        r, n = rank_world()
        c = x.shape[1] // n
        y = F.gelu(self.fc(x[:, r * c:(r + 1) * c]))
        if n == 1:
            return y
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts[::-1] if self.bug else parts, dim=1)
