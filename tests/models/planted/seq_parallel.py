"""Megatron's sequence parallelism written by hand (plain torch.distributed autograd Functions),
with two mistakes people make in it, beside the correct model (helper hbug6). Vocab 32, hidden
32, seq 8: seconds per world on the CPU.

The residual stream is split on the sequence between the blocks: each rank holds its S/TP
positions. The block's RMSNorm runs on that slice; the MLP's column-parallel `up` all-gathers the
sequence in its forward (its input grad, each rank's share of the columns, is reduce-scattered
back over the sequence in backward); the row-parallel `down` reduce-scatters its partial output
over the sequence (its backward all-gathers the grad). Every weight is held whole on every rank,
each rank using its slice (or its positions): the grads are summed over the ranks.

  sp_ok         correct
  sp_gather_split  `up`'s all-gather written with the backward of the LAST gather (before the
                replicated head, where every rank's grad is the whole one and a split is right):
                its backward takes this rank's slice of its own partial input grad instead of
                reduce-scattering the ranks' partials (Megatron's `tensor_parallel_output_grad`
                flag set wrong). The forward is exact; the norm's input grad misses the other
                ranks' columns.
  sp_pos_local / sp_pos_ok  learned absolute positions added to the sequence SLICE after the
                scatter (to save the embedding's memory); the mistake: the positions counted from
                0 on every rank, not from the rank's first position. Twin: offset by r * S / TP.

    tpdiag compare --model py:tests/models/planted/seq_parallel.py:sp_gather_split --tp 1,2
tests/test_seq_parallel.py; docs/planted.md has every case's verdict.
"""
import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mine(t):
    """This rank's slice of the positions (dim 1)."""
    r, n = rank_world()
    s = t.shape[1] // n
    return t[:, r * s:(r + 1) * s].contiguous()


def _all_gather_seq(t):
    parts = [torch.empty_like(t) for _ in range(rank_world()[1])]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 1)


def _reduce_scatter_seq(t):
    t = t.contiguous().clone()
    dist.all_reduce(t)  # gloo has no reduce-scatter: the sum, then this rank's positions
    return _mine(t)


class _Scatter(torch.autograd.Function):
    """Into the sequence-parallel region: this rank's positions; backward all-gathers."""

    @staticmethod
    def forward(ctx, x):
        return _mine(x)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g)


class _Gather(torch.autograd.Function):
    """Out of the sequence-parallel region: all-gather the positions. Backward: reduce-scatter when
    the consumer is tensor-parallel (its grads are the ranks' partials), else this rank's slice."""

    @staticmethod
    def forward(ctx, x, tp_output_grad):
        ctx.tp_output_grad = tp_output_grad
        return _all_gather_seq(x)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter_seq(g) if ctx.tp_output_grad else _mine(g)), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g)


def _sp(fn, x, *a):
    return fn.apply(x, *a) if rank_world()[1] > 1 else x


def sum_grad(p):
    def hook(g):
        if rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        sum_grad(self.weight)  # each rank normalises its own positions

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SPColumn(nn.Module):
    def __init__(self, reduce_scatter_grad):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        sum_grad(self.weight)
        self.reduce_scatter_grad = reduce_scatter_grad

    def forward(self, x):
        r, n = rank_world()
        x = _sp(_Gather, x, self.reduce_scatter_grad)
        return x @ self.weight[r * HIDDEN // n:(r + 1) * HIDDEN // n].t()


class SPRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        sum_grad(self.weight)

    def forward(self, h):
        r, n = rank_world()
        return _sp(_ReduceScatter, h @ self.weight[:, r * HIDDEN // n:(r + 1) * HIDDEN // n].t())


class MLP(nn.Module):
    def __init__(self, reduce_scatter_grad):
        super().__init__()
        self.up = SPColumn(reduce_scatter_grad)
        self.down = SPRow()

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class SPLM(nn.Module):
    def __init__(self, reduce_scatter_grad=True, positions=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = positions
        if positions is not None:
            self.wpe = nn.Embedding(SEQ, DIM)
            sum_grad(self.wpe.weight)  # each rank adds its own positions
        self.norm = RMSNorm()
        self.mlp = MLP(reduce_scatter_grad)
        self.norm_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = _sp(_Scatter, self.embed(tokens))
        if self.positions is not None:
            r, n = rank_world()
            s = x.shape[1]
            # the mistake ("local"): every rank's slice numbered from position 0
            start = 0 if self.positions == "local" else r * s
            x = x + self.wpe(torch.arange(start, start + s))
        x = x + self.mlp(self.norm(x))
        # the head is replicated: every rank computes the whole grad, so the gather's backward splits
        return self.head(self.norm_f(_sp(_Gather, x, False)))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(**kw):
    return tpdiag.Target(model=SPLM(**kw), plan={}, vocab_size=VOCAB, inputs=_tokens)


def sp_ok():
    return _target()


def sp_gather_split():
    return _target(reduce_scatter_grad=False)


def sp_pos_local():
    return _target(positions="local")


def sp_pos_ok():
    return _target(positions="global")
