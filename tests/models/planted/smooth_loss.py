"""Vocab-parallel cross-entropy with label smoothing, written by hand on the LM head's local vocab
shard (the head `ColwiseParallel()` in the plan: each rank's logits are its vocab shard) - helper
hbug12. loss = (1 - EPS) * (lse - z_y) + EPS * (lse - mean_v z_v), lse and z_y over the whole
vocabulary (the max, the sum of exp and the target logit all-reduced, as Megatron's).

  smooth_local  the smoothing term's mean over the vocabulary is the LOCAL shard's mean
                (`z.mean(-1)`, from a single-GPU codebase), never all-reduced: each rank's loss has
                its own smoothing term, none of them TP=1's
  smooth_avg    the shards' sums all-reduced with AVG, not SUM, then over the vocabulary's size:
                the same smoothing term on every rank, 1/n of TP=1's - a loss the ranks agree on
  smooth_ok     the twin: the shard's sum all-reduced, over the whole vocabulary's size

    tpdiag compare --model py:tests/models/planted/smooth_loss.py:smooth_local --tp 1,2
tests/test_smooth_loss.py.
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
EPS = 0.1


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Average(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        return t

    @staticmethod
    def backward(ctx, g):
        return g / rank_world()[1]


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def average(t):
    return _Average.apply(t) if rank_world()[1] > 1 else t


def smoothed_ce(local_logits, labels, local_mean):
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
    if local_mean == "avg":  # the mistake: the shards' sums AVERAGED (1/n of the sum), then / V
        mean = average(z.sum(-1)) / (per * n)
    else:  # the mistake (local_mean): the mean over this rank's shard of the vocabulary only
        mean = z.mean(-1) if local_mean else reduce(z.sum(-1)) / (per * n)
    return (((1 - EPS) * (lse - target) + EPS * (lse - mean)) * keep).sum() / keep.sum()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def _target(local_mean):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=LM(), plan={"head": ColwiseParallel()}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         loss=lambda logits, labels: smoothed_ce(logits, labels, local_mean))


def smooth_local():
    return _target(True)


def smooth_avg():
    return _target("avg")


def smooth_ok():
    return _target(False)
