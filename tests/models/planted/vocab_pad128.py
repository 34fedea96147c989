"""Megatron's default vocab padding (helper hbug8): `make_vocab_size_divisible_by=128`, the vocab
padded to a multiple of 128 * TP - so the padded size differs with TP (100 real ids: 128 rows at
TP=1, 256 at TP=2, rank 1's 128 all padding). A hand-written column-parallel LM head (this rank's
rows of the padded master, the padding rows zero) and Megatron's vocab-parallel cross-entropy on
this rank's padded shard.

  pad128_ok    the padding's logits set to -inf before the loss (Megatron masks them so).
  pad128_mass  the padding's logits left in the softmax: each adds exp(0 - max) to the exp sum,
               28 of them at TP=1 and 156 at TP=2 - a loss that changes with TP.

    tpdiag compare --model py:tests/models/planted/vocab_pad128.py:pad128_mass --tp 1,2
tests/test_vocab_pad128.py.
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ, DIVISIBLE_BY = 100, 16, 2, 8, 128


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def padded_vocab(vocab, tp):
    """Megatron's _vocab_size_with_padding."""
    multiple = DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


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


def _reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


class PaddedHead(nn.Module):
    def __init__(self):
        super().__init__()
        r, n = rank_world()
        self.per = padded_vocab(VOCAB, n) // n
        real = torch.randn(VOCAB, DIM) / DIM ** 0.5
        master = torch.cat([real, torch.zeros(self.per * n - VOCAB, DIM)])
        self.weight = nn.Parameter(master[r * self.per:(r + 1) * self.per].clone())

    def forward(self, x):
        return (_Copy.apply(x) if rank_world()[1] > 1 else x) @ self.weight.t()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = PaddedHead()

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def padded_ce(local_logits, labels, mask_pad: bool):
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    real = min(max(VOCAB - r * per, 0), per)
    if mask_pad and real < per:
        z = z.masked_fill(torch.arange(per, device=z.device) >= real, float("-inf"))
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(_reduce(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & (local < per)
    # masked_fill, not a product: rank 1's logits are all padding, -inf where masked (-inf * 0 is NaN)
    target = _reduce(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1).masked_fill(~(inside & keep), 0.0))
    return ((lse - target) * keep).sum() / keep.sum()


def _target(mask_pad):
    return tpdiag.Target(model=LM(), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         loss=lambda logits, labels: padded_ce(logits, labels, mask_pad))


def pad128_ok():
    return _target(True)


def pad128_mass():
    return _target(False)
