"""PPO's clipped surrogate against a rollout policy's logprobs, as an RL team's trainer computes it
(helper hplant19): a Megatron MLP (`ColwiseParallel()` up, `RowwiseParallel()` down) before
the norm; the policy head and the old policy's (the rollout's weights, a frozen copy drawn
near it) are both `ColwiseParallel()`; the trainer recomputes the old logprobs itself (no grad) and
each logprob at TP > 1 is Megatron's vocab-parallel one (the max, the exp-sum and the target logit
all-reduced). 8 x 128 tokens, ratios spread about the clip range's edges 1 +- eps. In bfloat16 the
MLP's all-reduce moves the logits by rounding, but the old logprobs are recomputed from the same
hidden state, so the ratio moves far less than either logprob: no clip decision flipped here (the
logits' grad 1.5e-5 at most from the reference's) - an engine's logprobs, fixed data, would not
cancel so.

  clip_ok         the correct loss.                                                     rounding
  clip_offset     the policy's target mask built from the GLOBAL id against the LOCAL vocab size
                  (the old policy's is right).                                          BUG (loss)

    tpdiag compare --model py:tests/models/planted/rl_ppo_clip.py:clip_ok --tp 1,2 --dtype bfloat16
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 8, 128
EPS = 0.2


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """All-reduce SUM forward; every rank computes the same loss from it: identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def logprobs(z, y, global_mask=False):
    """log p(y) from this rank's vocab shard z [tokens, V/TP]."""
    if rank_world()[1] == 1:
        return F.log_softmax(z, -1).gather(1, y.unsqueeze(1)).squeeze(1)
    r, _ = rank_world()
    per = z.shape[-1]
    m = z.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(_Reduce.apply(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    mine = (y >= 0) & (y < per) if global_mask else (y >= r * per) & (y < (r + 1) * per)
    t = z.gather(1, (y - r * per).clamp(0, per - 1).unsqueeze(1)).squeeze(1)
    return _Reduce.apply(t * mine) - lse


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.old_head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            self.old_head.weight.copy_(self.head.weight + 0.05 * torch.randn(VOCAB, DIM))
        self.old_head.weight.requires_grad_(False)
        self.old_logits = None

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = self.norm(h + self.mlp(h))
        with torch.no_grad():
            self.old_logits = self.old_head(h)
        return self.head(h)


def ppo(model, logits, labels, global_mask):
    z = logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    y = y.masked_fill(~keep, 0)
    lp = logprobs(z, y, global_mask)
    with torch.no_grad():
        old = logprobs(model.old_logits.flatten(0, -2).float(), y)
    ratio = torch.exp(lp - old)
    adv = torch.linspace(-1.0, 1.0, labels.shape[0]).repeat_interleave(labels.shape[1])
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    return -(surr * keep).sum() / keep.sum()


def _inputs(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    labels[:, :4] = -100  # the prompt
    return {"input_ids": ids, "labels": labels}


def _target(global_mask):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = LM()
    plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(), "head": ColwiseParallel(),
            "old_head": ColwiseParallel()}
    return tpdiag.Target(model=model, plan=plan,
                         vocab_size=VOCAB, inputs=_inputs,
                         loss=lambda logits, labels: ppo(model, logits, labels, global_mask))


def clip_ok():
    return _target(False)


def clip_offset():
    return _target(True)
