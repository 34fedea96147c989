"""User-style tensor parallelism written with plain torch.distributed calls and no plan.

Every rank holds the full weights (tpdiag seeds them identically) and each hand-written layer
slices its own share by rank, so tpdiag has no layout for these modules: their bounds and
causes must come from what the modules recorded. One FUNC per case, each correct one beside
its buggy twin (run forward-only: the in-place collectives have no autograd):
  row / row_bias_bug        row-parallel linear, partial sums all-reduced; the bug adds the
                            bias on every rank before the all-reduce (N x bias at TP=N)
  gather / gather_bug       column-parallel linear whose shards are all-gathered; the bug
                            concatenates them in reverse rank order
  scaled / scaled_bug       row-parallel projection scaled by 1/sqrt(fan-in); the bug uses
                            the local fan-in K/N instead of the global K (Megatron's
                            label-smoothing bug: a local size where the global one belongs)
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
        if self.bug:
            parts = parts[::-1]
        return torch.cat(parts, dim=-1)


class LM(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = layer
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        return self.head(self.proj(self.embed(input_ids)))


def _target(layer):
    model = LM(layer)
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
