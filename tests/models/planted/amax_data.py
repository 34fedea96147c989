"""A per-rank amax kept with writes autograd's version counter does not see (helper hleft11): a
column-parallel layer fake-quantises its output to 8-bit steps of the amax its previous training
forward saw, a BUFFER it updates through `.data` (as EMA and scaling code often does, to keep the
write out of autograd) and, where it syncs the ranks, with an in-place all-reduce on the buffer
itself. Each rank holds only its SHARD of `up` / `down` (sliced from a master drawn whole), so the
amax of its output is its shard's.

  local   the mistake: the amax kept per rank - the all-reduce forgotten, so the replicas differ
          and step 1 quantises each rank's shard with its own scale
  synced  the twin: the amax all-reduced with MAX in place on the buffer (bitwise TP=1's)

    tpdiag compare --model py:tests/models/planted/amax_data.py:local --tp 1,2 --steps 2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class Quantise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, amax):
        step = amax / 127
        return torch.round(y / step).clamp(-127, 127) * step

    @staticmethod
    def backward(ctx, g):
        return g, None


class QuantColumn(nn.Module):
    def __init__(self, sync):
        super().__init__()
        self.weight = nn.Parameter(shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.register_buffer("amax", torch.ones(()))
        self.sync = sync

    def forward(self, x):
        n = rank_world()[1]
        y = (Broadcast.apply(x) if n > 1 else x) @ self.weight.t()
        out = Quantise.apply(y, self.amax)
        if self.training:
            self.amax.data.copy_(y.detach().abs().amax())
            if self.sync and n > 1:
                dist.all_reduce(self.amax, op=dist.ReduceOp.MAX)
        return out


class MLP(nn.Module):
    def __init__(self, sync):
        super().__init__()
        self.up = QuantColumn(sync)
        self.down = nn.Parameter(shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))

    def forward(self, x):
        n = rank_world()[1]
        y = F.gelu(self.up(x)) @ self.down.t()
        return x + (AllReduce.apply(y) if n > 1 else y)


class LM(nn.Module):
    def __init__(self, sync):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(sync)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def build(sync):
    return tpdiag.Target(model=LM(sync), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def local():
    return build(False)


def synced():
    return build(True)
