"""Vocab-parallel cross-entropy with PaLM's z-loss (1e-4 * logsumexp**2, which keeps the softmax
normaliser near 1), written by hand on the LM head's local vocab shard (the head is
`ColwiseParallel()` in the plan: each rank's logits are its vocab shard) - helper hbug6.

  zloss_local  the cross-entropy's log-sum-exp is the whole vocabulary's (the max and the sum of
               exp all-reduced, as Megatron's), but the z-loss term squares the LOCAL shard's
               logsumexp (`local.logsumexp(-1)`, the one-liner from a single-GPU codebase): each
               rank adds its own z-loss, none of them TP=1's
  zloss_ok     the z-loss from the all-reduced log-sum-exp

    tpdiag compare --model py:tests/models/planted/zloss.py:zloss_local --tp 1,2
tests/test_attn_split.py runs it beside the attention cases; docs/planted.md has the verdicts.
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
Z = 1e-4


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """All-reduce forward; the ranks' grads are each rank's own terms: identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def vocab_parallel_ce_z(local_logits, labels, local_z: bool):
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(reduce(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & (local < per)
    target = reduce(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1) * (inside & keep))
    # the mistake (local_z): the z-loss from this rank's shard only
    zl = z.logsumexp(-1) if local_z else lse
    return ((lse - target + Z * zl ** 2) * keep).sum() / keep.sum()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(local_z):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=LM(), plan={"head": ColwiseParallel()}, vocab_size=VOCAB, inputs=_tokens,
                         loss=lambda logits, labels: vocab_parallel_ce_z(logits, labels, local_z))


def zloss_local():
    return _target(True)


def zloss_ok():
    return _target(False)
