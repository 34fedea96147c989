"""A user's Mamba2-style block split over the TP ranks by hand, Megatron's way (helper hplant17):
every rank holds the whole weights and uses its share (grads summed over the ranks by hooks); the
x and z projections column-parallel (each rank its D_INNER/TP channels), the depthwise causal conv
per channel, the gated RMSNorm over GROUPS of channels (Mamba2's RMSNormGated, norm_before_gate
False: y * silu(z), then each group of D_INNER/NGROUPS channels normalised by its own mean square),
the out projection row-parallel. NGROUPS is a multiple of TP, so each rank holds whole groups and
the norm needs no communication. Vocab 32, dim 16, d_inner 32 in 4 groups of 8, seq 8.

  groups_by_count  the mistake: the norm cuts its input into `self.ngroups` pieces (the config's
                   group COUNT, `y.view(..., self.ngroups, -1)`) - right at TP=1, but a rank holds
                   NGROUPS/TP groups, so at TP=2 each "group" is half a real one: every channel is
                   normalised by the mean square of 4 channels, not its group's 8.           BUG
  groups_by_size   the twin: cut into pieces of the group SIZE (`view(..., -1, group_size)`).
                                                                                          rounding
    tpdiag compare --model py:tests/models/planted/mamba_norm.py:groups_by_count --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, D_INNER, NGROUPS, CONV, BATCH, SEQ = 32, 16, 32, 4, 4, 2, 8


def tp_rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, the input grad summed over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the partial outputs summed over the ranks, identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def _sum_grads_over_ranks(p):
    def hook(g):
        if tp_rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class GatedRMSNorm(nn.Module):
    def __init__(self, width, ngroups, by_count, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        _sum_grads_over_ranks(self.weight)
        self.ngroups, self.group_size, self.eps = ngroups, width // ngroups, eps
        self.by_count = by_count

    def forward(self, y, z):
        r, n = tp_rank_world()
        local = y.shape[-1]
        y = y * F.silu(z)
        if self.by_count:
            g = y.view(*y.shape[:-1], self.ngroups, -1)
        else:
            g = y.view(*y.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.view_as(y) * self.weight[r * local:(r + 1) * local]


class Mamba2Mixer(nn.Module):
    def __init__(self, by_count):
        super().__init__()
        self.in_x = nn.Parameter(torch.randn(D_INNER, DIM) / DIM ** 0.5)
        self.in_z = nn.Parameter(torch.randn(D_INNER, DIM) / DIM ** 0.5)
        self.conv = nn.Parameter(torch.randn(D_INNER, 1, CONV) / CONV ** 0.5)
        self.out = nn.Parameter(torch.randn(DIM, D_INNER) / D_INNER ** 0.5)
        for p in (self.in_x, self.in_z, self.conv, self.out):
            _sum_grads_over_ranks(p)
        self.norm = GatedRMSNorm(D_INNER, NGROUPS, by_count)

    def forward(self, h):
        r, n = tp_rank_world()
        mine = slice(r * D_INNER // n, (r + 1) * D_INNER // n)
        if n > 1:
            h = _CopyToTP.apply(h)
        x, z = F.linear(h, self.in_x[mine]), F.linear(h, self.in_z[mine])
        # depthwise causal conv over the sequence, one filter per channel (Mamba's conv1d)
        xs = F.pad(x.transpose(1, 2), (CONV - 1, 0))
        x = F.silu(F.conv1d(xs, self.conv[mine], groups=x.shape[-1])).transpose(1, 2)
        o = F.linear(self.norm(x, z), self.out[:, mine])
        return _ReduceFromTP.apply(o) if n > 1 else o


class MambaLM(nn.Module):
    def __init__(self, by_count):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer = Mamba2Mixer(by_count)
        self.norm_f = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.mixer(h)
        return self.lm_head(self.norm_f(h))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def groups_by_count():
    return tpdiag.Target(model=MambaLM(by_count=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def groups_by_size():
    return tpdiag.Target(model=MambaLM(by_count=False), plan={}, vocab_size=VOCAB, inputs=_tokens)
