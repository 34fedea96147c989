"""Megatron-style mistakes a user makes in the BACKWARD and the LOSS of hand-written TP (plain
torch.distributed autograd Functions), each with its correct twin (`good`):

  f_missing   the column-parallel MLP reads its input without Megatron's `f` (identity forward,
              all-reduce backward): each rank's dL/dx holds only its own columns' share, so the
              embedding's grad is a partial sum - a different one on each rank
  f_twice     `f` applied twice: the input grad all-reduced twice, the MLP's share TP times too big
  ce_max      vocab-parallel cross-entropy whose max is the local shard's (not all-reduced): each
              rank subtracts its own max before the all-reduced sum of exp - wrong log-sum-exp
  ce_edge     vocab-parallel cross-entropy whose target mask is off by one at the shard's upper
              edge (`<= per`): a label equal to the first id of the NEXT shard is also picked by
              this rank (its clamped last logit) - only tokens at a shard edge are wrong
  ce_smooth_local  label smoothing whose mean logit divides the all-reduced sum by the local
              vocab partition instead of the vocabulary (twin: `ce_smooth`)
  tied_one    embedding and head share one weight, each rank using its vocab rows; the
              embedding's side all-reduces its grad (through an autograd Function on the weight),
              the head's side does not - the tied grad is half summed, the replicas drift
  tp_dropout_same  dropout on the column-parallel hidden shard, every rank drawing its shard's mask
              from one seed: the ranks' masks are the same numbers (correlated), not TP=1's mask;
              its twin `tp_dropout_sliced` draws the whole mask from the seed and keeps its columns
  rep_dropout dropout on the replicated residual stream (after the all-reduce) drawn from a
              generator seeded with the rank: the replicas see different masks
Hidden 32, vocab 32, seq 8: seconds per world on the CPU.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """Megatron's g: the partial values summed in forward; identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces each rank's partial input grad."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


def sum_grad(p):
    """Each rank holds the whole parameter but uses its slice: the grads are summed."""
    def hook(g):
        if rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class MLP(nn.Module):
    def __init__(self, f="once", dropout=None):
        super().__init__()
        self.dropout = dropout
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)
        self.f = f

    def forward(self, x):
        r, n = rank_world()
        m = HIDDEN // n
        cols = slice(r * m, (r + 1) * m)
        xs = x if self.f == "missing" else copy(x)
        if self.f == "twice":
            xs = copy(xs)
        h = F.gelu(xs @ self.up[cols].t())
        if self.dropout is not None:
            g = torch.Generator().manual_seed(7)  # the same seed on every rank
            if self.dropout == "same":  # the mistake: each rank draws its shard's mask from it
                keep = torch.rand(h.shape, generator=g) >= 0.1
            else:  # "sliced": the whole mask drawn, this rank's columns kept (TP=1's mask)
                keep = (torch.rand(*h.shape[:-1], HIDDEN, generator=g) >= 0.1)[..., cols]
            h = h * keep.to(h.dtype) / 0.9
        return x + reduce(h @ self.down[:, cols].t())


class LM(nn.Module):
    def __init__(self, f="once", dropout_seed=None, per_rank=True, tp_dropout=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(f, tp_dropout)
        self.norm = nn.LayerNorm(DIM)
        # split by the plan (ColwiseParallel): each rank's logits are its vocab shard
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.dropout_seed, self.per_rank = dropout_seed, per_rank

    def forward(self, tokens):
        h = self.mlp(self.embed(tokens))
        if self.dropout_seed is not None:
            # the mistake: a generator per rank (as for data parallelism) on a replicated tensor
            g = torch.Generator().manual_seed(self.dropout_seed + rank_world()[0] * self.per_rank)
            keep = (torch.rand(h.shape, generator=g) >= 0.1).to(h.dtype)
            h = h * keep / 0.9
        return self.head(self.norm(h))


def vocab_parallel_ce(local_logits, labels, bug=None):
    """Cross-entropy from this rank's vocab shard of the logits (Megatron's)."""
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1 and bug != "max":
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(reduce(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & ((local <= per) if bug == "edge" else (local < per))
    picked = z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1) * (inside & keep)
    target = reduce(picked)
    if bug in ("smooth", "smooth_local"):
        # label smoothing 0.1: the mean logit over the vocabulary, from the shards' sums; the
        # mistake (Megatron-LM issue 737) divides by the local partition size, not the vocabulary
        mean = reduce(z.sum(-1)) / (per if bug == "smooth_local" else per * n)
        return (((lse - 0.9 * target - 0.1 * mean)) * keep).sum() / keep.sum()
    return ((lse - target) * keep).sum() / keep.sum()


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(model, ce=None):
    return tpdiag.Target(model=model, plan={"head": ColwiseParallel()}, vocab_size=VOCAB,
                         inputs=_tokens, loss=lambda logits, labels: vocab_parallel_ce(logits, labels, ce))


def good():
    return _target(LM())


def f_missing():
    return _target(LM(f="missing"))


def f_twice():
    return _target(LM(f="twice"))


def ce_max():
    return _target(LM(), ce="max")


def ce_edge():
    return _target(LM(), ce="edge")


def tp_dropout_same():
    return _target(LM(tp_dropout="same"))


def tp_dropout_sliced():
    return _target(LM(tp_dropout="sliced"))


def ce_smooth():
    return _target(LM(), ce="smooth")


def ce_smooth_local():
    return _target(LM(), ce="smooth_local")


def rep_dropout():
    return _target(LM(dropout_seed=7))


def rep_dropout_good():
    """The twin: one seed for the replicated stream, the same mask on every rank."""
    return _target(LM(dropout_seed=7, per_rank=False))


class _SumGradOf(torch.autograd.Function):
    """Identity forward on a weight; backward all-reduces its grad (the embedding's side)."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class TiedLM(nn.Module):
    """Vocab-parallel embedding and head sharing one weight; rank r uses rows [r V/N, (r+1) V/N)."""

    def __init__(self, one_side):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.1)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)
        self.one_side = one_side
        if not one_side:
            sum_grad(self.weight)  # the whole tied grad (both uses) summed over the ranks

    def forward(self, tokens):
        r, n = rank_world()
        per = VOCAB // n
        rows = slice(r * per, (r + 1) * per)
        w = self.weight
        if n > 1 and self.one_side:
            w_embed = _SumGradOf.apply(w)  # only the embedding's use is summed
        else:
            w_embed = w
        local = tokens - r * per
        inside = ((local >= 0) & (local < per)).unsqueeze(-1)
        h = reduce(F.embedding(local.clamp(0, per - 1), w_embed[rows]) * inside)
        h = self.norm(self.mlp(h))
        local = copy(h) @ w[rows].t()  # this rank's vocab shard of the logits
        return _GatherVocab.apply(local) if n > 1 else local


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocab shards of the logits; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, y):
        r, n = rank_world()
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        ctx.r, ctx.m = r, y.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.m:(ctx.r + 1) * ctx.m].contiguous()


def _tied(one_side):
    # the logits come back whole: tpdiag's built-in cross-entropy
    return tpdiag.Target(model=TiedLM(one_side), plan={}, vocab_size=VOCAB, inputs=_tokens)


def tied_good():
    return _tied(False)


def tied_one():
    return _tied(True)
