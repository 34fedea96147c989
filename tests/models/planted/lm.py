"""A small LM a user shards by hand, trained a step (forward, backward, optimizer): the three
planted mistakes that live outside one forward layer, each with its correct twin.

  embed_bug   vocab-parallel embedding: rank r owns rows [r V/N, (r+1) V/N); the mistake: ids
              outside its range are clamped into it instead of masked to zero
  loss_bug    vocab-parallel cross-entropy on the head's local vocab shard; the mistake: the
              log-sum-exp taken over the local shard only (no all-reduce)
  grad_bug    a replicated per-feature gain applied to a column-parallel shard; the mistake: its
              grad is left as each rank's partial (never all-reduced), so the replicas drift
              (every other replicated weight here has its grad summed: each rank uses a slice)
  good        all three written correctly
The reductions in forward are Megatron's g (identity backward); grads are summed in hooks.
"""
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 64, 32, 64, 2, 8
warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _ReduceSum(torch.autograd.Function):
    """Megatron's g: the partial values summed in forward; the output is replicated (every rank
    goes on with the same value and computes the same loss), so its grad is the same on every
    rank and passes through as is. (torch.distributed.nn.functional.all_reduce all-reduces the
    grad too: with replicated consumers each activation grad comes out TP times too large -
    issue 57's own-input verdict found it here, in what was meant as the correct twin.)"""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def reduce_sum(t):
    if rank_world()[1] == 1:
        return t
    if torch.is_grad_enabled() and t.requires_grad:
        return _ReduceSum.apply(t)
    return dnn.all_reduce(t)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, the input grad all-reduced in backward (each rank's
    column shard contributes its part of dL/dx)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


def copy_to_tp(x):
    return _CopyToTP.apply(x) if rank_world()[1] > 1 else x


def sum_grad(p):
    """Every rank holds the whole parameter but uses only its slice, so its grad covers that
    slice: the replicas stay equal only if the grads are summed over the ranks."""
    p.register_hook(lambda g: reduce_sum(g) if rank_world()[1] > 1 else g)


class VocabEmbedding(nn.Module):
    def __init__(self, bug):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM))
        self.bug = bug
        sum_grad(self.weight)

    def forward(self, ids):
        r, n = rank_world()
        per = VOCAB // n
        lo = r * per
        local = ids - lo
        inside = (local >= 0) & (local < per)
        rows = self.weight[lo:lo + per]
        if self.bug:
            out = F.embedding(local.clamp(0, per - 1), rows)
        else:
            out = F.embedding(local.clamp(0, per - 1), rows) * inside.unsqueeze(-1)
        return reduce_sum(out)


class GainMLP(nn.Module):
    """x -> column-parallel up (local shard) * gain[shard] -> gelu -> row-parallel down."""

    def __init__(self, bug):
        super().__init__()
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)
        if not bug:
            sum_grad(self.gain)

    def forward(self, x):
        r, n = rank_world()
        m = HIDDEN // n
        cols = slice(r * m, (r + 1) * m)
        h = F.gelu((copy_to_tp(x) @ self.up[cols].t()) * self.gain[cols])
        return x + reduce_sum(h @ self.down[:, cols].t())


class LM(nn.Module):
    def __init__(self, embed_bug=False, grad_bug=False):
        super().__init__()
        self.embed = VocabEmbedding(embed_bug)
        self.mlp = GainMLP(grad_bug)
        # split by the plan (ColwiseParallel, torch's default local output): at TP > 1 each
        # rank's forward returns its own vocab shard of the logits
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.mlp(self.embed(tokens)))


def vocab_parallel_ce(local_logits, labels, bug=False):
    """Cross-entropy from this rank's vocab shard of the logits (Megatron-style)."""
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    if bug:
        lse = torch.logsumexp(z, dim=-1)
    else:
        m = z.detach().amax(-1, keepdim=True)
        if n > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
        lse = torch.log(reduce_sum(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    mine = (local >= 0) & (local < per) & keep
    picked = z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1) * mine
    target = reduce_sum(picked)
    return ((lse - target) * keep).sum() / keep.sum()


def _target(loss_bug=False, **kw):
    return tpdiag.Target(model=LM(**kw), plan={"head": ColwiseParallel()}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         loss=lambda logits, labels: vocab_parallel_ce(logits, labels, loss_bug))


def good():
    return _target()


def embed_bug():
    return _target(embed_bug=True)


def loss_bug():
    return _target(loss_bug=True)


def grad_bug():
    return _target(grad_bug=True)
