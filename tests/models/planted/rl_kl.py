"""A GRPO loss with a KL penalty to a frozen reference policy, both heads vocab-parallel, as an RL
team writes it (helper hplant19). The policy's head and the reference's (a frozen copy drawn near
it, `requires_grad=False`) are both `ColwiseParallel()`; the model keeps the reference's logits of
its last call (`ref_logits`, no grad) and the loss reads them. Per token: the on-policy surrogate
-A * ratio (ratio = exp(logp - logp.detach())) plus beta * k3, the k3 estimator of KL(pi || ref),
exp(ref_lp - lp) - (ref_lp - lp) - 1, token-mean. The trainer's vocab-parallel logprob at TP > 1
is Megatron's (the max, the exp-sum and the target logit all-reduced).

  kl_ref_local  the reference's logprob from its SHARD's own log-sum-exp (the target's rank
                subtracts its own shard's normaliser, then the ranks' terms are summed); the
                policy's logprob is right.                                              BUG (loss)
  kl_ok         the twin: both logprobs from the all-reduced normaliser.                rounding

    tpdiag compare --model py:tests/models/planted/rl_kl.py:kl_ref_local --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
BETA = 0.05


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


def _lse(z, local):
    m = z.detach().amax(-1, keepdim=True)
    if not local:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    s = torch.exp(z - m).sum(-1)
    return torch.log(s if local else _Reduce.apply(s)) + m.squeeze(-1)


def logprobs(z, y, local_lse=False):
    """log p(y) from this rank's vocab shard z [tokens, V/TP]."""
    if rank_world()[1] == 1:
        return F.log_softmax(z, -1).gather(1, y.unsqueeze(1)).squeeze(1)
    r, _ = rank_world()
    per = z.shape[-1]
    mine = (y >= r * per) & (y < (r + 1) * per)
    t = z.gather(1, (y - r * per).clamp(0, per - 1).unsqueeze(1)).squeeze(1)
    if local_lse:  # the target's own rank subtracts its shard's normaliser
        return _Reduce.apply((t - _lse(z, True)) * mine)
    return _Reduce.apply(t * mine) - _lse(z, False)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.ref_head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            self.ref_head.weight.copy_(self.head.weight + 0.05 * torch.randn(VOCAB, DIM))
        self.ref_head.weight.requires_grad_(False)
        self.ref_logits = None

    def forward(self, input_ids):
        h = self.norm(self.embed(input_ids))
        with torch.no_grad():
            self.ref_logits = self.ref_head(h)
        return self.head(h)


def grpo_kl(model, logits, labels, local_ref):
    z = logits.flatten(0, -2).float()
    zr = model.ref_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    y = y.masked_fill(~keep, 0)
    lp = logprobs(z, y)
    ref_lp = logprobs(zr, y, local_lse=local_ref)
    ratio = torch.exp(lp - lp.detach())
    adv = torch.linspace(-1.0, 1.0, labels.shape[0]).repeat_interleave(labels.shape[1])
    d = ref_lp - lp
    k3 = torch.exp(d) - d - 1
    return ((-adv * ratio + BETA * k3) * keep).sum() / keep.sum()


def _inputs(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    labels[:, :2] = -100  # the prompt
    return {"input_ids": ids, "labels": labels}


def _target(local_ref):
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = LM()
    return tpdiag.Target(model=model, plan={"head": ColwiseParallel(), "ref_head": ColwiseParallel()},
                         vocab_size=VOCAB, inputs=_inputs,
                         loss=lambda logits, labels: grpo_kl(model, logits, labels, local_ref))


def kl_ref_local():
    return _target(True)


def kl_ok():
    return _target(False)
