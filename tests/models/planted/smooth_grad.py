"""Vocab-parallel cross-entropy with label smoothing as ONE autograd Function with its own backward
(Megatron's `VocabParallelCrossEntropy` shape), written by hand on the LM head's local vocab shard
(the head `ColwiseParallel()`: each rank's logits are its vocab shard) - helper hbug12. Forward:
loss_i = lse_i - (1 - EPS) z_iy - EPS mean_v z_iv, every sum over the whole vocabulary
(all-reduced). Backward: d loss_i / d z_iv = softmax_iv - (1 - EPS) [v = y_i] - EPS / V.

  smooth_grad_local  the backward's smoothing share is EPS / (the LOCAL shard's width): right at
                     TP=1, at TP=2 every logit's grad is EPS / V too low - a shift, not a scale.
                     The forward (the loss) is right.
  smooth_grad_ok     the twin: EPS / V, V the whole vocabulary

    tpdiag compare --model py:tests/models/planted/smooth_grad.py:smooth_grad_local --tp 1,2
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


def _sum(t, op=None):
    if rank_world()[1] > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


class SmoothedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, y, local_share):
        r, n = rank_world()
        per = z.shape[-1]
        m = _sum(z.amax(-1, keepdim=True), dist.ReduceOp.MAX if n > 1 else None)
        e = torch.exp(z - m)
        s = _sum(e.sum(-1, keepdim=True))
        local = y - r * per
        inside = (local >= 0) & (local < per)
        zy = _sum(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1) * inside)
        zmean = _sum(z.sum(-1)) / (per * n)
        loss = torch.log(s.squeeze(-1)) + m.squeeze(-1) - (1 - EPS) * zy - EPS * zmean
        ctx.save_for_backward(e / s, local, inside)
        # the mistake (local_share): the smoothing's share over this rank's vocabulary only
        ctx.share = EPS / (per if local_share else per * n)
        return loss

    @staticmethod
    def backward(ctx, g):
        p, local, inside = ctx.saved_tensors
        grad = p - ctx.share
        rows = torch.arange(grad.shape[0])[inside]
        grad[rows, local[inside]] -= 1 - EPS
        return grad * g.unsqueeze(-1), None, None


def smoothed_ce(local_logits, labels, local_share):
    z = local_logits.flatten(0, -2).float()
    return SmoothedCE.apply(z, labels.flatten(), local_share).mean()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def _target(local_share):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=LM(), plan={"head": ColwiseParallel()}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         loss=lambda logits, labels: smoothed_ce(logits, labels, local_share))


def smooth_grad_local():
    return _target(True)


def smooth_grad_ok():
    return _target(False)
