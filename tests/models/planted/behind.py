"""TP mistakes that sit BEHIND an earlier harmless reordering, as a user writes them by hand: the
first divergence is a correct row-parallel MLP's all-reduce (rounding), and every record after
it differs by that rounding too - so each later module must be judged on its own inputs.

  avg_bug     kv: k/v weights replicated on every rank, each rank using its head slice through
              a "copy to the TP region" autograd function on the WEIGHT; its backward all-reduces
              the ranks' partial weight grads with AVG instead of SUM - the forward is exact, the
              k/v weight grads are 1/TP of the truth
  sp_bug      norm: a sequence-parallel RMSNorm (each rank normalises its slice of the sequence,
              then all-gathers); its replicated weight's grad is never all-reduced
  loss_scaled the loss (Target.loss) multiplied by the TP degree
  bugs        avg_bug and sp_bug together (one run finds both)
  good        all written correctly (SUM, all-reduced norm grad, unscaled loss)
Every collective is hand-written with torch.distributed (no plan, no DTensor).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 16, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _AllReduce(torch.autograd.Function):
    """Megatron's g: sum in forward, identity backward (the output is replicated)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces each rank's partial grad. `avg`
    is the mistake: the ranks' partial grads averaged (op=AVG) as a data-parallel grad is."""

    @staticmethod
    def forward(ctx, x, avg):
        ctx.avg = avg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        if ctx.avg:
            g = g / dist.get_world_size()  # gloo has no ReduceOp.AVG: the same mistake by hand
        return g, None


def copy_to_tp(x, avg=False):
    return _CopyToTP.apply(x, avg) if rank_world()[1] > 1 else x


class _Split(torch.autograd.Function):
    """Scatter to the sequence-parallel region: this rank's slice of dim 1; backward all-gathers."""

    @staticmethod
    def forward(ctx, x):
        r, n = rank_world()
        m = x.shape[1] // n
        return x[:, r * m:(r + 1) * m].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(rank_world()[1])]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, dim=1)


class _Gather(torch.autograd.Function):
    """Gather from the sequence-parallel region (dim 1); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, y):
        r, n = rank_world()
        parts = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(parts, y.contiguous())
        ctx.r, ctx.m = r, y.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        return g[:, ctx.r * ctx.m:(ctx.r + 1) * ctx.m].contiguous()


class RowMLP(nn.Module):
    """Correct: column-parallel up, row-parallel down, the partial outputs summed (a reordering)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        for p in (self.up, self.down):  # each rank's grad covers its slice: summed
            p.register_hook(lambda g: _sum(g))

    def forward(self, x):
        r, n = rank_world()
        if n == 1:
            return x + F.gelu(x @ self.up.t()) @ self.down.t()
        m = HIDDEN // n
        cols = slice(r * m, (r + 1) * m)
        h = F.gelu(copy_to_tp(x) @ self.up[cols].t())
        return x + _AllReduce.apply(h @ self.down[:, cols].t())


def _sum(g):
    if rank_world()[1] > 1:
        g = g.clone()
        dist.all_reduce(g)
    return g


class KV(nn.Module):
    """k/v projections, heads split over the ranks; each rank keeps the whole (replicated) k/v
    weights and reads its heads' rows through copy_to_tp, whose backward sums (or, the mistake,
    averages) the ranks' partial weight grads. Output: silu(k) * v, gathered over the heads."""

    def __init__(self, avg):
        super().__init__()
        self.wk = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.wv = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.avg = avg

    def forward(self, x):
        r, n = rank_world()
        if n == 1:
            return x + F.silu(x @ self.wk.t()) * (x @ self.wv.t())
        m = DIM // n
        rows = slice(r * m, (r + 1) * m)
        xs = copy_to_tp(x)
        wk, wv = copy_to_tp(self.wk, self.avg), copy_to_tp(self.wv, self.avg)
        local = F.silu(xs @ wk[rows].t()) * (xs @ wv[rows].t())
        parts = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(parts, local.contiguous())
        # the gather's backward is this rank's slice: written as an autograd-aware concat of
        # the local value with the other ranks' (detached) parts
        parts[r] = local
        return x + torch.cat(parts, dim=-1)


class SPNorm(nn.Module):
    """Sequence-parallel RMSNorm: each rank normalises its slice of the sequence, then the
    slices are gathered. The weight is replicated and each rank's grad covers its slice, so
    the grads must be all-reduced (`bug`: they are not)."""

    def __init__(self, bug):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        if not bug:
            self.weight.register_hook(lambda g: _sum(g))

    def forward(self, x):
        n = rank_world()[1]
        if n > 1:
            x = _Split.apply(x)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return _Gather.apply(y) if n > 1 else y


class LM(nn.Module):
    def __init__(self, avg=False, sp_bug=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = RowMLP()
        self.kv = KV(avg)
        self.norm = SPNorm(sp_bug)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.kv(self.mlp(self.embed(tokens)))))


def _loss(scaled):
    def loss(logits, labels):
        ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
        return ce * rank_world()[1] if scaled else ce
    return loss


def _target(scaled=False, **kw):
    return tpdiag.Target(model=LM(**kw), plan={}, vocab_size=VOCAB, loss=_loss(scaled),
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def good():
    return _target()


def bugs():
    """avg_bug and sp_bug in one model: independent mistakes, each at its own module."""
    return _target(avg=True, sp_bug=True)


def avg_bug():
    return _target(avg=True)


def sp_bug():
    return _target(sp_bug=True)


def loss_scaled():
    return _target(scaled=True)
