"""A user's hand-written TP language model (helper hbug13d): a vocab-parallel embedding, a
column-parallel FFN whose hidden units are mixed by a softmax-with-temperature over the (sharded)
hidden width, a row-parallel down projection. Each rank holds the whole weights and uses its
slice; a grad hook sums the ranks' grads. Vocab 32, dim 16, hidden 32, seq 8.

  lookup_wrap   the vocab-parallel embedding maps every id into its shard with `% per` and
                forgets the mask: each rank adds a garbage row for every id outside its shard,
                and the all-reduce sums them in.                                         BUG
  lookup_clamp  the same, the ids clamped into the shard instead.                         BUG
  lookup_ok     ids outside the shard masked to zero rows before the all-reduce.          rounding
  dgrad_avg     the column-parallel input's `f` averages the ranks' partial input grads
                (sum / TP, as DDP averages) instead of summing them: the forward exact, the
                input grad 1/TP of what it is - a mistake in the BACKWARD alone.         BUG
  gate_local    the softmax over the hidden width subtracts each rank's OWN max and sums the
                ranks' exp-sums without rescaling them to a common max: another function. BUG
  chan_ok       a LayerNorm over the column-parallel hidden width from each shard's (mean, M2),
                combined by Chan's parallel formula after an all-gather: the whole width's
                statistics.                                                            rounding
  chan_module   the same, combined by a module of its own (ffn.combine).              rounding
  chan_within   that module sums the shards' M2s alone (the spread of the shards' means left
                out of the variance).                                                    BUG
  gate_ok       the max all-reduced (MAX) first, then the exp-sums summed.              rounding
  gate_rescale  each rank's own max, its exp terms rescaled by exp(m_r - max) before the sum
                (online softmax): mathematically the whole width's softmax.           rounding
  gate_rescale_module  the same, the maxes all-reduced by a module of its own.         rounding
  gate_rescale_sign    that module's rescale written exp(max - m_r): the sign flipped. BUG

    tpdiag compare --model py:tests/models/planted/vocab_lookup.py:lookup_wrap --tp 1,2
tests/test_vocab_lookup.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 16, 32, 2, 8
TEMP = 0.5


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """all-reduce forward (the output is replicated), identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """identity forward; backward sums (or, `avg`, averages) the ranks' partial input grads."""

    @staticmethod
    def forward(ctx, x, avg):
        ctx.avg = avg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        if ctx.avg:  # the mistake: "average the grads across ranks", as data parallel does
            g = g / dist.get_world_size()
        return g, None


class _Max(torch.autograd.Function):
    """all-reduce MAX; no grad (a stability shift whose grad cancels)."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def sum_all(t):
    if rank_world()[1] == 1:
        return t
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t)


def copy(t, avg=False):
    return _Copy.apply(t, avg) if rank_world()[1] > 1 else t


def sum_grad(p):
    def hook(g):
        if rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, lookup: str):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM))
        self.lookup = lookup
        sum_grad(self.weight)

    def forward(self, ids):
        r, n = rank_world()
        per = VOCAB // n
        start = r * per
        shard = self.weight[start:start + per]
        if self.lookup == "wrap":  # the mistake: every id wrapped into the shard, no mask
            return reduce(F.embedding((ids - start) % per, shard))
        if self.lookup == "clamp":  # the mistake: every id clamped into the shard, no mask
            return reduce(F.embedding((ids - start).clamp(0, per - 1), shard))
        outside = (ids < start) | (ids >= start + per)
        rows = F.embedding((ids - start).masked_fill(outside, 0), shard)
        return reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class MaxRanks(nn.Module):
    """The all-reduce of the shards' maxes as a module of its own."""

    def forward(self, m):
        return _Max.apply(m) if rank_world()[1] > 1 else m


class GatedFFN(nn.Module):
    """up (column-parallel) -> softmax over the hidden width with a temperature -> down."""

    def __init__(self, gate: str, avg_dgrad: bool):
        super().__init__()
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)
        self.gate, self.avg_dgrad = gate, avg_dgrad
        self.max_ranks = MaxRanks()

    def forward(self, x):
        r, n = rank_world()
        cols = slice(r * HIDDEN // n, (r + 1) * HIDDEN // n)
        h = copy(x, self.avg_dgrad) @ self.up[cols].t() / TEMP
        m = h.detach().amax(-1, keepdim=True)
        if self.gate == "all" and n > 1:
            m = _Max.apply(m)
        e = torch.exp(h - m)  # "local" keeps the rank's own max: the ranks' sums are unlike terms
        if self.gate == "rescale" and n > 1:  # online-softmax style: each shard's terms moved to the
            e = e * torch.exp(m - _Max.apply(m))  # common max afterwards - the same function
        if self.gate == "rescale_module":
            e = e * torch.exp(m - self.max_ranks(m))
        if self.gate == "rescale_sign":  # the mistake: the shift's sign flipped
            e = e * torch.exp(self.max_ranks(m) - m)
        p = e / sum_all(e.sum(-1, keepdim=True))
        return x + reduce((p * HIDDEN) @ self.down[:, cols].t())


def gather_ranks(t):
    """[TP, *t.shape]: every rank's t, on every rank (its backward hands each rank its grad)."""
    if rank_world()[1] == 1:
        return t.unsqueeze(0)
    from torch.distributed.nn.functional import all_gather

    return torch.stack(all_gather(t))


class CombineMoments(nn.Module):
    """Chan's parallel combination of the ranks' (mean, M2) over equal-sized shards; `within`: the
    mistake of summing the M2s alone (the spread between the shards' means left out)."""

    def __init__(self, within=False):
        super().__init__()
        self.within = within

    def forward(self, mean, m2):
        means, m2s = gather_ranks(mean), gather_ranks(m2)
        mu = means.mean(0)
        per = HIDDEN // means.shape[0]
        if self.within:
            return mu, m2s.sum(0) / HIDDEN
        return mu, (m2s.sum(0) + per * (means - mu).pow(2).sum(0)) / HIDDEN


class ChanFFN(nn.Module):
    """up (column-parallel) -> LayerNorm over the HIDDEN width from the shards' moments -> gelu ->
    down (row-parallel). `module`: the moments combined by a module of its own."""

    def __init__(self, module: bool):
        super().__init__()
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)
        self.combine = CombineMoments(module == "within") if module else None

    def forward(self, x):
        r, n = rank_world()
        cols = slice(r * HIDDEN // n, (r + 1) * HIDDEN // n)
        h = copy(x) @ self.up[cols].t()
        mean = h.mean(-1, keepdim=True)
        d = h - mean  # each shard's deviations from its own mean (Welford/Chan style)
        m2 = d.pow(2).sum(-1, keepdim=True)
        if self.combine is not None:
            mu, var = self.combine(mean, m2)
        else:
            mu, var = CombineMoments().forward(mean, m2)
        h = (d + (mean - mu)) * torch.rsqrt(var + 1e-5)
        return x + reduce(F.gelu(h) @ self.down[:, cols].t())


class LookupLM(nn.Module):
    def __init__(self, lookup="mask", gate="all", avg_dgrad=False, chan=None):
        super().__init__()
        self.embed = VocabParallelEmbedding(lookup)
        self.ffn = GatedFFN(gate, avg_dgrad) if chan is None else ChanFFN(chan if chan != "inline" else None)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.ffn(self.embed(tokens))))


def _tokens(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, 1:5] = torch.tensor([VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1, 0])  # both shards' edges
    return ids


def _target(**kw):
    return tpdiag.Target(model=LookupLM(**kw), plan={}, vocab_size=VOCAB, inputs=_tokens)


def lookup_wrap():
    return _target(lookup="wrap")


def lookup_clamp():
    return _target(lookup="clamp")


def lookup_ok():
    return _target()


def dgrad_avg():
    return _target(avg_dgrad=True)


def gate_local():
    return _target(gate="local")


def gate_rescale():
    return _target(gate="rescale")


def gate_rescale_module():
    return _target(gate="rescale_module")


def gate_rescale_sign():
    return _target(gate="rescale_sign")


def chan_ok():
    return _target(chan="inline")


def chan_module():
    return _target(chan="module")


def chan_within():
    return _target(chan="within")


def gate_ok():
    return _target()
