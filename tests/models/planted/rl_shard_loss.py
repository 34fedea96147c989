"""RL-side loss terms written by hand on the LM head's local vocab shard (the head is
`ColwiseParallel()`: each rank's logits are its vocab shard), as an RL team adds them to a
vocab-parallel cross-entropy (helper hbug11). The CE itself is right in every case (Megatron's: the
max, the exp-sum and the target logit all-reduced).

  entropy_local  an entropy bonus (-0.01 * H) whose softmax is the rank's SHARD's (its own max and
                 exp-sum), the ranks' entropies then summed: at TP=2 the sum of two shard
                 entropies, not the vocabulary's
  entropy_id_bwd the entropy from the all-reduced normaliser, its p log p summed over the ranks -
                 but the normaliser's all-reduce has Megatron's identity backward (right for a
                 cross-entropy, whose every rank computes the same loss from it; here each rank's
                 entropy terms differ, so each rank's grad of it is its own shard's share): the
                 loss is exact, the logits' grad is not (tests/test_rl_shard_loss.py)
  entropy_ok     the same with the normaliser all-reduced by torch.distributed.nn.functional's
                 all_reduce (its backward sums the ranks' grads)
  grpo_local     an on-policy GRPO/PPO surrogate, -A * min(ratio, clip(ratio)) with
                 ratio = exp(logp - logp.detach()): logp is the target's logit minus the LOCAL
                 shard's logsumexp (on the rank that holds the target, then summed). The forward is
                 exact at every degree (ratio == 1); the policy gradient is not
  grpo_ok        logp from the all-reduced logsumexp

    tpdiag compare --model py:tests/models/planted/rl_shard_loss.py:entropy_local --tp 1,2
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
BETA, EPS = 0.01, 0.2


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """All-reduce forward; each rank's grad is its own term's: identity backward."""

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


def _lse(z, local: bool, grad_sum: bool = False):
    """log-sum-exp over the vocabulary (local: over this rank's shard only; grad_sum: the exp-sum's
    all-reduce sums the ranks' grads in backward, as every rank's own terms need)."""
    m = z.detach().amax(-1, keepdim=True)
    if rank_world()[1] > 1 and not local:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    s = torch.exp(z - m).sum(-1)
    if not local and grad_sum and rank_world()[1] > 1:
        from torch.distributed.nn.functional import all_reduce

        return torch.log(all_reduce(s)) + m.squeeze(-1)
    return torch.log(s if local else reduce(s)) + m.squeeze(-1)


def _target_logit(z, y, keep):
    r, _ = rank_world()
    per = z.shape[-1]
    local = y - r * per
    inside = (local >= 0) & (local < per)
    return z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1), inside & keep


def ce_entropy(local_logits, labels, local: bool, grad_sum: bool = False):
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    lse = _lse(z, False)
    t, mine = _target_logit(z, y, keep)
    target = reduce(t * mine)
    nll = lse - target
    lse_h = _lse(z, True) if local else _lse(z, False, grad_sum)  # local: the shard's own normaliser
    logp = z - lse_h.unsqueeze(-1)
    ent = reduce(-(logp.exp() * logp).sum(-1))
    return ((nll - BETA * ent) * keep).sum() / keep.sum()


def grpo(local_logits, labels, local: bool):
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    t, mine = _target_logit(z, y, keep)
    if local:  # the mistake: the target's logprob on its own rank, from that shard's normaliser
        logp = reduce((t - _lse(z, True)) * mine)
    else:  # every rank subtracts the whole vocabulary's lse (its backward: this shard's softmax)
        logp = reduce(t * mine) - _lse(z, False)
    ratio = torch.exp(logp - logp.detach())
    # one advantage per sequence, group-normalised as GRPO does (a fixed function of the row)
    adv = torch.linspace(-1.0, 1.0, labels.shape[0]).repeat_interleave(labels.shape[1])
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    return -(surr * keep).sum() / keep.sum()


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


def _target(loss):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=LM(), plan={"head": ColwiseParallel()}, vocab_size=VOCAB, inputs=_tokens,
                         loss=loss)


def entropy_local():
    return _target(lambda logits, labels: ce_entropy(logits, labels, True))


def entropy_id_bwd():
    return _target(lambda logits, labels: ce_entropy(logits, labels, False))


def entropy_ok():
    return _target(lambda logits, labels: ce_entropy(logits, labels, False, True))


def grpo_local():
    return _target(lambda logits, labels: grpo(logits, labels, True))


def grpo_ok():
    return _target(lambda logits, labels: grpo(logits, labels, False))
