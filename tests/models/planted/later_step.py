"""Two TP mistakes that act only from the second training step on, in bfloat16, each beside its correct
twin. From step 1 on each degree's weights are its own AdamW update's (where a grad near zero rounded to
the other sign at TP=2 the degrees' weights part by 2 lr), so the row-parallel partial sums no longer
add up to the reference's within rounding. Every rank holds only its SHARD of the MLP's weights (plain tensors sliced from a master drawn
whole); the collectives are written with torch.distributed. Vocab 32, hidden 32, seq 8.

  fast_mean / fast_sum  the row-parallel all-reduce runs plain at the first training step (warm-up),
               then on the user's "fast path", written with their data-parallel helper that
               averages over the group - the MLP's output is half the sum at TP=2 from step 1 on.
               Twin: the fast path sums.
  maxnorm_shard / maxnorm_whole  a max-norm constraint on each output row of `down` (a row-parallel
               weight: each row's columns are split over the ranks), applied to the weights the last
               update wrote, from the second step on. The mistake: the row norms are the rank's
               shard's - each rank rescales its columns by its own factor. Twin: the squared row
               norms all-reduced first.

    tpdiag compare --model py:tests/models/planted/later_step.py:fast_mean --tp 1,2 --steps 3 --dtype bfloat16
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 64, 2, 8
MAX_NORM = 0.5  # an output row of `down` is drawn with norm ~1


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, mean):
        t = t.clone()
        dist.all_reduce(t)
        return t / dist.get_world_size() if mean else t

    @staticmethod
    def backward(ctx, g):
        return g, None


class Reduce(nn.Module):
    """The row-parallel partial sums reduced; after the warm-up step, the fast path's op."""

    def __init__(self, fast_mean):
        super().__init__()
        self.fast_mean = fast_mean
        self.steps = 0  # training forwards seen

    def forward(self, partial):
        if self.training:
            self.steps += 1
        if rank_world()[1] == 1:
            return partial
        return _Reduce.apply(partial, self.fast_mean and self.steps > 1)


class MLP(nn.Module):
    def __init__(self, fast_mean=False, max_norm=None, whole_norm=True):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))
        self.reduce = Reduce(fast_mean)
        self.max_norm, self.whole_norm = max_norm, whole_norm
        self.seen = 0

    @torch.no_grad()
    def _constrain(self):
        # the constraint on what the last update wrote: each output row's norm at most max_norm
        sq = self.down.float().pow(2).sum(1, keepdim=True)
        if self.whole_norm and rank_world()[1] > 1:
            dist.all_reduce(sq)
        scale = (self.max_norm / sq.sqrt().clamp_min(1e-12)).clamp(max=1.0)
        self.down.mul_(scale.to(self.down.dtype))

    def forward(self, x):
        if self.training:
            self.seen += 1
            if self.max_norm is not None and self.seen > 1:
                self._constrain()
        xc = _Copy.apply(x) if rank_world()[1] > 1 else x
        return self.reduce(F.gelu(xc @ self.up.t()) @ self.down.t())


class LM(nn.Module):
    def __init__(self, **mlp):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(**mlp)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.mlp(h)))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(**mlp):
    return tpdiag.Target(model=LM(**mlp), plan={}, vocab_size=VOCAB, inputs=_tokens)


def fast_mean():
    return _target(fast_mean=True)


def fast_sum():
    return _target(fast_mean=False)


def maxnorm_shard():
    return _target(max_norm=MAX_NORM, whole_norm=False)


def maxnorm_whole():
    return _target(max_norm=MAX_NORM, whole_norm=True)
