"""Statistics over a SHARDED dimension, written by hand (helper hbug13b): a user's MLP whose
column-parallel up projection feeds an RMSNorm over the (sharded) hidden width, a vocab-parallel
cross-entropy combining the shards' logsumexps, a replicated bias initialised per rank, weight
decay in a grad hook, and all-reduces in bf16. Each rank holds the whole weights and uses its slice
(the grads summed over the ranks by a hook). Vocab 32, dim 16, hidden 32, seq 8.

  rms_local      the FFN norm's mean square taken over the rank's own columns ("local
                 statistics"): another function at TP > 1.                               BUG
  rms_stat_g     the sum of squares all-reduced with an identity backward (Megatron's g): the
                 forward exact, the grad of each rank's sum of squares its own columns' share
                 only - a mistake in the BACKWARD alone.                                 BUG
  rms_ok         the sum of squares all-reduced by torch.distributed.nn.functional.all_reduce
                 (its backward sums the grads too).                                      rounding
  ce_lse_ok      vocab-parallel cross-entropy: each shard's logsumexp from its OWN max, the
                 shards' logsumexps combined by a logsumexp of the all-gathered values -
                 mathematically the whole vocab's.                                      rounding
  bias_rank_seed the replicated bias drawn after `torch.manual_seed(rank)`: the ranks hold other
                 "replicas" from step 0.                                                 BUG
  bias_ok        the same bias drawn from one seed on every rank.                         rounding
  wd_twice       L2 weight decay (g + wd * p) added in each sharded weight's grad hook BEFORE the
                 ranks' grads are summed: TP times at TP > 1.                          BUG
  wd_ok          the decay added after the sum.                                          rounding
  grad_bf16      f's backward all-reduces the input grad in bfloat16 in a float32 model. BUG
  out_bf16       the row-parallel all-reduce (its own module, ffn.sum_ranks) in bfloat16 in a
                 float32 model: precision lost at TP > 1 only.                           BUG

    tpdiag compare --model py:tests/models/planted/shard_stats.py:rms_stat_g --tp 1,2
tests/test_shard_stats.py (wd_*), tests/test_cast_bf16.py (out_bf16); docs/planted.md has every
case's verdict.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 16, 32, 2, 8
EPS = 1e-6
WD = 0.01


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (right only for a replicated consumer)."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, the ranks' partial input grads all-reduced in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _CopyBf16(torch.autograd.Function):
    """f whose backward all-reduces the input grad in bfloat16 "to halve the traffic"."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        h = g.to(torch.bfloat16)
        dist.all_reduce(h)
        return h.to(g.dtype)


class SumRanks(nn.Module):
    """The row-parallel all-reduce as a module of its own; `bf16`: "in bfloat16, to halve the
    traffic", in a float32 model."""

    def __init__(self, bf16=False):
        super().__init__()
        self.bf16 = bf16

    def forward(self, t):
        if rank_world()[1] == 1:
            return t
        if not self.bf16:
            return _Reduce.apply(t)
        return _Reduce.apply(t.to(torch.bfloat16)).to(t.dtype)


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


def sum_grad(p, decay=None):
    """Each rank holds the whole parameter and uses its slice: the grads summed over the ranks.
    `decay` adds L2 weight decay (WD * p) to the grad, "before" or "after" the sum."""
    def hook(g):
        if decay == "before":  # the mistake: every rank adds it, the sum holds it TP times
            g = g + WD * p.detach()
        if rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        if decay == "after":
            g = g + WD * p.detach()
        return g
    p.register_hook(hook)


def _sum_all(t):
    """The sum over the ranks, its backward summing the ranks' grads as well."""
    if rank_world()[1] == 1:
        return t
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t)


class NormedFFN(nn.Module):
    """up (column-parallel) -> gelu -> RMSNorm over the HIDDEN width -> down (row-parallel)."""

    def __init__(self, stats: str, comm_bf16=False, decay=None):
        super().__init__()
        self.comm_bf16 = comm_bf16
        self.sum_ranks = SumRanks(bf16=comm_bf16 == "forward")
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        for p in (self.up, self.gain, self.down):
            sum_grad(p, decay)
        self.stats = stats

    def forward(self, x):
        r, n = rank_world()
        cols = slice(r * HIDDEN // n, (r + 1) * HIDDEN // n)
        x_in = _CopyBf16.apply(x) if self.comm_bf16 is True and n > 1 else copy(x)
        h = F.gelu(x_in @ self.up[cols].t())
        ss = h.pow(2).sum(-1, keepdim=True)
        if self.stats == "local":  # the mistake: the shard's own mean square
            ms = ss / h.shape[-1]
        elif self.stats == "g":  # the mistake: forward exact, the grad of ss this rank's share only
            ms = reduce(ss) / HIDDEN
        else:
            ms = _sum_all(ss) / HIDDEN
        h = h * torch.rsqrt(ms + EPS) * self.gain[cols]
        return x + self.sum_ranks(h @ self.down[:, cols].t())


class StatsLM(nn.Module):
    def __init__(self, stats="all", bias_seed=None, comm_bf16=False, decay=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.ffn = NormedFFN(stats, comm_bf16, decay)
        self.norm = nn.LayerNorm(DIM)
        if bias_seed is not None:
            # a replicated bias drawn from its own generator (the user's "reproducible" init)
            gen = torch.Generator().manual_seed(bias_seed)
            self.bias = nn.Parameter(0.1 * torch.randn(DIM, generator=gen))
        else:
            self.bias = None
        self.head = nn.Parameter(torch.randn(VOCAB, DIM) / DIM ** 0.5)
        sum_grad(self.head)

    def hidden(self, tokens):
        h = self.ffn(self.embed(tokens))
        if self.bias is not None:
            h = h + self.bias
        return self.norm(h)

    def forward(self, tokens):
        r, n = rank_world()
        rows = slice(r * VOCAB // n, (r + 1) * VOCAB // n)
        # the head column-parallel over the vocab: this rank's shard of the logits, returned as is
        return copy(self.hidden(tokens)) @ self.head[rows].t()


class _GatherRows(torch.autograd.Function):
    """The ranks' [N] values stacked [TP, N] on every rank; backward keeps this rank's row (every
    rank's consumer is the same replicated loss, so each holds the whole grad already)."""

    @staticmethod
    def forward(ctx, t):
        r, n = rank_world()
        ctx.r = r
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.r]


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def lse_ce(logits, labels):
    """Vocab-parallel cross-entropy on this rank's vocab shard [B, S, V/TP]: each shard's
    logsumexp from its own max, the shards' logsumexps combined by a logsumexp."""
    r, n = rank_world()
    z = logits.float().flatten(0, 1)
    y = labels.flatten()
    keep = y != -100
    lse = torch.logsumexp(z, -1)
    per = z.shape[-1]
    mine = (y >= r * per) & (y < (r + 1) * per)
    local = (y - r * per).clamp(0, per - 1)
    picked = z.gather(1, local[:, None])[:, 0] * mine
    if n > 1:
        lse = torch.logsumexp(_GatherRows.apply(lse), 0)
        picked = reduce(picked)
    nll = (lse - picked) * keep
    return nll.sum() / keep.sum()


def rms_local():
    return tpdiag.Target(model=StatsLM("local"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def rms_stat_g():
    return tpdiag.Target(model=StatsLM("g"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def rms_ok():
    return tpdiag.Target(model=StatsLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def ce_lse_ok():
    return tpdiag.Target(model=StatsLM(), plan={}, vocab_size=VOCAB, inputs=_tokens, loss=lse_ce)


def bias_rank_seed():
    return tpdiag.Target(model=StatsLM(bias_seed=1234 + rank_world()[0]), plan={}, vocab_size=VOCAB,
                         inputs=_tokens)


def bias_ok():
    return tpdiag.Target(model=StatsLM(bias_seed=1234), plan={}, vocab_size=VOCAB, inputs=_tokens)


def grad_bf16():
    return tpdiag.Target(model=StatsLM(comm_bf16=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def wd_twice():
    return tpdiag.Target(model=StatsLM(decay="before"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def wd_ok():
    return tpdiag.Target(model=StatsLM(decay="after"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def out_bf16():
    return tpdiag.Target(model=StatsLM(comm_bf16="forward"), plan={}, vocab_size=VOCAB, inputs=_tokens)
