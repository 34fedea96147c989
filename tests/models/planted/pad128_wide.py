"""Megatron's default vocab padding on a model whose hidden width is the padded width too (helper
hbug9): 100 real ids padded to a multiple of 128 * TP (128 rows at TP=1, 256 at TP=2) and a hidden
size of 128 - so every [.., 128] activation has the shape of a rank's padded logits. A replicated
embedding, a hand-written column/row-parallel MLP (each rank its shard of a master drawn whole),
a LayerNorm, a column-parallel padded head and Megatron's vocab-parallel cross-entropy with the
padding masked.

  wide_ok        correct: rounding only (the row-parallel all-reduce)
  wide_rank_drop the residual stream after the MLP (replicated: every rank holds all of it) goes
                 through dropout drawn from a generator seeded by the rank (a data-parallel habit):
                 rank 0 draws TP=1's mask, rank 1 another - the replicas differ from there on
  wide_bias      the row-parallel projection adds its bias on every rank before the all-reduce
                 (TP times the bias): the ranks agree, all wrong

    tpdiag compare --model py:tests/models/planted/pad128_wide.py:wide_rank_drop --tp 1,2
tests/test_pad128_wide.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ, DIVISIBLE_BY = 100, 128, 64, 2, 8, 128


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def padded_vocab(vocab, tp):
    """Megatron's _vocab_size_with_padding."""
    multiple = DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


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


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


class MLP(nn.Module):
    def __init__(self, bias_everywhere):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.bias_everywhere = bias_everywhere

    def forward(self, x):
        h = F.gelu(copy(x) @ self.up.t())
        y = h @ self.down.t()
        if self.bias_everywhere:
            return reduce(y + self.bias)  # the mistake: TP copies of the bias summed
        return reduce(y) + self.bias


class PaddedHead(nn.Module):
    def __init__(self):
        super().__init__()
        r, n = rank_world()
        self.per = padded_vocab(VOCAB, n) // n
        real = torch.randn(VOCAB, DIM) / DIM ** 0.5
        master = torch.cat([real, torch.zeros(self.per * n - VOCAB, DIM)])
        self.weight = nn.Parameter(master[r * self.per:(r + 1) * self.per].clone())

    def forward(self, x):
        return copy(x) @ self.weight.t()


class LM(nn.Module):
    def __init__(self, rank_drop=False, bias_everywhere=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(bias_everywhere)
        self.norm = nn.LayerNorm(DIM)
        self.head = PaddedHead()
        self.rank_drop = rank_drop

    def forward(self, tokens):
        x = self.embed(tokens)
        h = x + self.mlp(x)
        if self.rank_drop:
            g = torch.Generator(device=h.device).manual_seed(11 + rank_world()[0])  # the mistake: seeded per rank
            h = h * (torch.rand(h.shape, generator=g, device=h.device) >= 0.1).to(h.dtype) / 0.9
        return self.head(self.norm(h))


def padded_ce(local_logits, labels):
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    real = min(max(VOCAB - r * per, 0), per)
    if real < per:
        z = z.masked_fill(torch.arange(per, device=z.device) >= real, float("-inf"))
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(reduce(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & (local < per)
    target = reduce(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1).masked_fill(~(inside & keep), 0.0))
    return ((lse - target) * keep).sum() / keep.sum()


def _target(**kw):
    return tpdiag.Target(model=LM(**kw), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         loss=padded_ce)


def wide_ok():
    return _target()


def wide_rank_drop():
    return _target(rank_drop=True)


def wide_bias():
    return _target(bias_everywhere=True)
