"""A LoRA adapter on a hand-written row-parallel MLP down projection (helper hbug12). Rank r holds
`up` rows and `down` columns [r FF/n, (r+1) FF/n) of one full draw; the adapter's `lora_a`
(RANK x FF) is cut along FF as `down` is, `lora_b` (DIM x RANK) is whole on every rank. The
adapter's output is ALPHA * lora_b(lora_a(h)). Vocab 32, hidden 32, ffn 64.

  lora_every_rank  the adapter's down-projection input is made whole first (`lora_a`'s partial
                   sums all-reduced: "the adapter sees the full hidden"), and its output added to
                   the rank's PARTIAL down output before the all-reduce - every rank adds it, so
                   the sum holds it n times (TP x the adapter).
  lora_zero_b      the same mistake with peft's init (`lora_b` zeros): the adapter adds 0, so the
                   forward is right; the backward is not - `lora_b`'s grad is the whole adapter
                   input's on every rank, summed over the ranks: n times TP=1's.
  lora_ok          the twin: each rank adds lora_b(lora_a_r(h_r)) - its own partial sum of the
                   adapter, linear in the shard - before the all-reduce, once per rank's share.

    tpdiag compare --model py:tests/models/planted/lora_row.py:lora_every_rank --tp 1,2
tests/test_lora_row.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, RANK, BATCH, SEQ = 32, 32, 64, 4, 2, 8
ALPHA = 2.0


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
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


def tp(fn, t):
    return fn.apply(t) if rank_world()[1] > 1 else t


class LoraMLP(nn.Module):
    def __init__(self, whole_adapter, zero_b):
        super().__init__()
        r, n = rank_world()
        k = FF // n
        cols = slice(r * k, (r + 1) * k)
        up, down = torch.randn(FF, DIM) / DIM ** 0.5, torch.randn(DIM, FF) / FF ** 0.5
        a, b = torch.randn(RANK, FF) / FF ** 0.5, torch.randn(DIM, RANK) / RANK ** 0.5
        self.up = nn.Parameter(up[cols].clone())
        self.down = nn.Parameter(down[:, cols].clone())
        self.lora_a = nn.Parameter(a[:, cols].clone())
        self.lora_b = nn.Parameter(torch.zeros_like(b) if zero_b else b)
        self.whole_adapter = whole_adapter

    def forward(self, x):
        h = F.gelu(F.linear(tp(_Copy, x), self.up))
        partial = F.linear(h, self.down)
        ah = F.linear(h, self.lora_a)
        # the mistake (whole_adapter): the adapter's input made whole, its output added on every rank
        if self.whole_adapter:
            ah = tp(_Reduce, ah)
        # lora_b is whole on every rank: its grad from each rank's share is summed (tp(_Copy, ...))
        partial = partial + ALPHA * F.linear(ah, tp(_Copy, self.lora_b))
        return x + tp(_Reduce, partial)


class LM(nn.Module):
    def __init__(self, whole_adapter, zero_b):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = LoraMLP(whole_adapter, zero_b)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _target(whole_adapter, zero_b=False):
    return tpdiag.Target(model=LM(whole_adapter, zero_b), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def lora_every_rank():
    return _target(True)


def lora_zero_b():
    return _target(True, zero_b=True)


def lora_ok():
    return _target(False)
