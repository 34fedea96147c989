"""A GRPO loss over a sequence-parallel LM's own positions, the response mask built by the loss
from each sequence's prompt length, as an RL team writes it (helper hplant19). The residual stream
is split on the sequence from the embedding on (each rank its S/TP positions, Megatron-style
autograd functions by hand), the replicated MLP and head run on the rank's positions (their grads
summed over the ranks by hooks); the logits are gathered over the sequence before the model returns
them, and the loss takes the rank's own positions again (the gather's backward keeps the rank's
positions' grads). The two prompts are 3 and 5 tokens long, so the ranks hold different numbers of
response tokens. Per token the on-policy surrogate -A * exp(logp - logp.detach()).

  mask_local_pos   the response mask from the rank's LOCAL position index (`arange(S/TP) >=
                   prompt_len`): at TP=2 rank 1 masks its first positions as prompt.   BUG (loss)
  seqmean_local    GRPO's sequence mean (each response's token mean, then the mean over
                   responses) whose per-response token count is the rank's LOCAL count: each
                   rank's partial mean is summed over the ranks - a sum of means.      BUG (loss)
  mask_ok          the twin of mask_local_pos: positions offset by the rank's first one; the
                   token-mean's sum and count all-reduced.                              rounding
  seqmean_ok       the twin of seqmean_local: each response's sum and count all-reduced, then
                   divided.                                                             rounding

    tpdiag compare --model py:tests/models/planted/rl_sp_mask.py:mask_local_pos --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
PROMPT = (3, 5)


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


class _Sum(torch.autograd.Function):
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
    return _Sum.apply(t) if sp_world()[1] > 1 else t


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
        logits = self.head(self.norm(h))
        return _GatherSeq.apply(logits) if sp_world()[1] > 1 else logits


def _loss(how):
    def loss(logits, labels):
        r, n = sp_world()
        if n > 1:
            logits, labels = my_positions(logits), my_positions(labels)
        s = labels.shape[1]
        pos = torch.arange(s) if how == "mask_local_pos" else torch.arange(s) + r * s
        resp = pos.unsqueeze(0) >= torch.tensor(PROMPT).unsqueeze(1)  # [B, s]
        keep = resp & (labels != -100)
        lp = F.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(lp - lp.detach())
        adv = torch.linspace(-1.0, 1.0, labels.shape[0]).unsqueeze(1)
        tok = -adv * ratio * keep
        if how.startswith("seqmean"):
            if how == "seqmean_local":  # this rank's count of each response's tokens
                per_seq = summed(tok.sum(1) / keep.sum(1).clamp(min=1))
            else:
                per_seq = summed(tok.sum(1)) / summed(keep.sum(1).float())
            return per_seq.mean()
        return summed(tok.sum()) / summed(keep.sum().float())
    return loss


def _inputs(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    return {"input_ids": ids, "labels": labels}


def _target(how):
    return tpdiag.Target(model=SPLM(), plan={}, vocab_size=VOCAB, inputs=_inputs, loss=_loss(how),
                         loss_mean="sequence" if how.startswith("seqmean") else "token")


def mask_local_pos():
    return _target("mask_local_pos")


def mask_ok():
    return _target("mask_ok")


def seqmean_local():
    return _target("seqmean_local")


def seqmean_ok():
    return _target("seqmean_ok")
