"""User-style tensor parallelism written with plain torch.distributed calls and no plan.

Every rank holds the full weights (tpdiag seeds them identically) and each hand-written layer
slices its own share by rank, so tpdiag has no layout for these modules: their bounds and
causes must come from what the modules recorded. One FUNC per case, each correct one beside
its buggy twin (run forward-only: the in-place collectives have no autograd):
  row / row_bias_bug        row-parallel linear, partial sums all-reduced; the bug adds the
                            bias on every rank before the all-reduce (N x bias at TP=N)
  gather / gather_bug       column-parallel linear whose shards are all-gathered; the bug
                            concatenates them in reverse rank order
  gather_dim_bug            the same, concatenated on the wrong dim and reshaped back
  scaled / scaled_bug       row-parallel projection scaled by 1/sqrt(fan-in); the bug uses
                            the local fan-in K/N instead of the global K (Megatron's
                            label-smoothing bug: a local size where the global one belongs)
  split_gather_bug          a column shard (own module, no communication) and a separate,
                            parameter-free all-gather module that reverses the rank order
  good                      every correct layer above in one model (row, gather, scaled,
                            split + gather): none may be called a sharding bug
  bugs                      every bug above in one model, as parallel branches of the same
                            input, so each is judged on its own in one world
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 64, 64, 2, 8


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RowParallelLinear(nn.Module):
    def __init__(self, din, dout, bug=False, scaled=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / din ** 0.5)
        self.bias = nn.Parameter(torch.randn(dout) * 0.1) if scaled is None else None
        self.bug, self.scaled = bug, scaled

    def forward(self, x):
        r, n = _rank_world()
        k = x.shape[-1] // n
        y = x[..., r * k:(r + 1) * k] @ self.weight[:, r * k:(r + 1) * k].t()
        if self.scaled is not None:
            fan_in = k if self.scaled == "local" else x.shape[-1]
            y = y * fan_in ** -0.5
        if self.bias is not None and self.bug:
            y = y + self.bias
        if n > 1:
            dist.all_reduce(y)
        if self.bias is not None and not self.bug:
            y = y + self.bias
        return y


class GatheredColumnLinear(nn.Module):
    def __init__(self, din, dout, bug=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / din ** 0.5)
        self.bias = nn.Parameter(torch.randn(dout) * 0.1)
        self.bug = bug

    def forward(self, x):
        r, n = _rank_world()
        m = self.weight.shape[0] // n
        y = x @ self.weight[r * m:(r + 1) * m].t() + self.bias[r * m:(r + 1) * m]
        if n == 1:
            return y
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        if self.bug == "dim":
            return torch.cat(parts, dim=-2).reshape(*y.shape[:-1], n * m)
        if self.bug:
            parts = parts[::-1]
        return torch.cat(parts, dim=-1)


class ColumnShard(nn.Module):
    """This rank's output columns of x W^T: a plain local shard, no communication."""

    def __init__(self, din, dout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / din ** 0.5)

    def forward(self, x):
        r, n = _rank_world()
        m = self.weight.shape[0] // n
        return x @ self.weight[r * m:(r + 1) * m].t()


class GatherLast(nn.Module):
    """Hand-written all-gather of the last dim; no parameters."""

    def __init__(self, bug=False):
        super().__init__()
        self.bug = bug

    def forward(self, y):
        r, n = _rank_world()
        if n == 1:
            return y
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts[::-1] if self.bug else parts, dim=-1)


class LM(nn.Module):
    def __init__(self, *layers: nn.Module, branches=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.branches = branches

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if self.branches:  # every layer reads the same (bitwise equal) input: judged apart
            return self.head(h + sum(layer(h) for layer in self.layers))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _target(*layers, branches=False):
    model = LM(*layers, branches=branches)
    return tpdiag.Target(model=model, plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def row():
    return _target(RowParallelLinear(DIM, DIM))


def row_bias_bug():
    return _target(RowParallelLinear(DIM, DIM, bug=True))


def gather():
    return _target(GatheredColumnLinear(DIM, DIM))


def gather_bug():
    return _target(GatheredColumnLinear(DIM, DIM, bug=True))


def scaled():
    return _target(RowParallelLinear(DIM, DIM, scaled="global"))


def scaled_bug():
    return _target(RowParallelLinear(DIM, DIM, scaled="local"))


def gather_dim_bug():
    return _target(GatheredColumnLinear(DIM, DIM, bug="dim"))


def split_gather_bug():
    return _target(nn.Sequential(ColumnShard(DIM, DIM), GatherLast(bug=True)))


def good():
    return _target(RowParallelLinear(DIM, DIM), GatheredColumnLinear(DIM, DIM),
                   RowParallelLinear(DIM, DIM, scaled="global"),
                   nn.Sequential(ColumnShard(DIM, DIM), GatherLast()))


def bugs():
    return _target(RowParallelLinear(DIM, DIM, bug=True), GatheredColumnLinear(DIM, DIM, bug=True),
                   GatheredColumnLinear(DIM, DIM, bug="dim"),
                   RowParallelLinear(DIM, DIM, scaled="local"),
                   nn.Sequential(ColumnShard(DIM, DIM), GatherLast(bug=True)), branches=True)
