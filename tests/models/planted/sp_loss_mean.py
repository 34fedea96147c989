"""A loss over a sequence-parallel LM's own positions (helper hred14): the residual stream is split on
the sequence from the embedding on (each rank its S/TP positions, Megatron-style autograd functions
by hand), the replicated MLP and head run on the rank's positions (their grads summed over the
ranks by hooks); the logits are gathered over the sequence before the model returns them (tpdiag
reads every position's), and the loss takes the rank's own positions of the logits and labels
again (the gather's backward keeps the rank's positions' grads). Padding (-100) sits at the ends of the sequences, so the ranks hold different numbers
of real tokens. Vocab 32, hidden 32, seq 8.

  sp_mean_of_means  each rank's mean over its own real tokens, the ranks' means averaged (the
                    all-reduce divided by TP): a mean of means - 8 and 5 tokens weigh alike, so the
                    loss (and every grad) is not TP=1's token mean.
  sp_token_mean     the twin: the sums of the token losses and the token counts all-reduced, one
                    division.

    tpdiag compare --model py:tests/models/planted/sp_loss_mean.py:sp_mean_of_means --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8


def sp_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def my_positions(t):
    r, n = sp_world()
    s = t.shape[1] // n
    return t[:, r * s:(r + 1) * s]


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return my_positions(x).contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(sp_world()[1])]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, 1)


class _GatherSeq(torch.autograd.Function):
    """Every position's logits; the loss reads only the rank's own: backward keeps those."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(sp_world()[1])]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        return my_positions(g).contiguous()


class _SumLoss(torch.autograd.Function):
    """The ranks' loss terms summed; each rank's term's grad is its own: identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def summed(t):
    return _SumLoss.apply(t) if sp_world()[1] > 1 else t


def _sum_grads(module):
    def hook(g):
        if sp_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    for p in module.parameters():
        p.register_hook(hook)


class SPLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        for m in (self.mlp, self.norm, self.head):
            _sum_grads(m)  # each rank's grads cover its own positions

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if sp_world()[1] > 1:
            h = _ScatterSeq.apply(h)
        h = h + self.mlp(h)
        logits = self.head(self.norm(h))  # this rank's positions' logits
        return _GatherSeq.apply(logits) if sp_world()[1] > 1 else logits


def _loss(mean_of_means):
    def loss(logits, labels):
        if sp_world()[1] > 1:
            logits, labels = my_positions(logits), my_positions(labels)
        y = labels
        tok = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="none")
        real = (y.flatten() != -100)
        if mean_of_means:
            # the mistake: this rank's mean, then the ranks' means averaged
            return summed((tok * real).sum() / real.sum()) / sp_world()[1]
        return summed((tok * real).sum()) / summed(real.sum().float())
    return loss


def _inputs(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    labels[1, -3:] = -100  # the second sequence ends early: padding
    return {"input_ids": ids, "labels": labels}


def _target(mean_of_means):
    return tpdiag.Target(model=SPLM(), plan={}, vocab_size=VOCAB, inputs=_inputs, loss=_loss(mean_of_means))


def sp_mean_of_means():
    return _target(True)


def sp_token_mean():
    return _target(False)
