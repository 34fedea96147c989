"""An HF-layout LM written by hand (helper hreview18): the root holds the body as `self.model` and the
head as `self.lm_head` (LlamaForCausalLM's names) and owns one parameter itself, a per-channel scale
of the body's output (a user's learned output gain). The body is a Megatron-style TP MLP block (f/g
by hand, `up` split by rows, `down` by columns); the scale, the norms and the head are replicated.

  scale_ok    the scale multiplies the body's output as it is on every rank             rounding
  scale_f     the scale goes through Megatron's f (identity forward, all-reduce backward) first,
              as if it were a sharded activation: its grad, already whole on every rank, is
              summed over the ranks - TP x its value                                         BUG

    tpdiag compare --model py:tests/models/planted/root_param.py:scale_f --tp 1,2
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


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return nn.Parameter(master.narrow(dim, r * per, per).clone())


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = _shard(torch.randn(FFN, DIM) / DIM ** 0.5, 0)
        self.down = _shard(torch.randn(DIM, FFN) / FFN ** 0.5, 1)

    def forward(self, x):
        n = rank_world()[1]
        y = F.linear(F.gelu(F.linear(_Copy.apply(x) if n > 1 else x, self.up)), self.down)
        return _Reduce.apply(y) if n > 1 else y


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        x = x + self.mlp(self.ln(x))
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, through_f):
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.out_scale = nn.Parameter(1.0 + 0.1 * torch.randn(DIM))
        self.through_f = through_f

    def forward(self, tokens):
        s = self.out_scale
        if self.through_f and rank_world()[1] > 1:
            s = _Copy.apply(s)
        return self.lm_head(self.model(tokens) * s)


def _target(through_f):
    return tpdiag.Target(model=CausalLM(through_f), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def scale_ok():
    return _target(False)


def scale_f():
    return _target(True)
