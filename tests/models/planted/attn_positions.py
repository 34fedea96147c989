"""Positions inside a hand-written parallel attention (helper hbug13b). Each rank holds the whole
weights and uses its slice (grads summed over the ranks by a hook). Vocab 32, dim 16, 4 heads of
4, seq 8.

  rope_rank_offset  heads split over the ranks, the rotary positions offset by the rank's
                    sequence start (`r * S / TP`, code copied from a sequence-parallel layer):
                    rank 1's heads are rotated as if at positions 4..11.              BUG
  rope_ok           the same heads, positions 0..S-1 on every rank.                   rounding
  cp_mask_local     the positions split over the ranks (context parallel), K and V all-gathered,
                    the causal mask built from the LOCAL query index (tril on [S/TP, S]): rank
                    1's queries see only the first S/TP keys.                          BUG
  cp_ok             the mask's diagonal offset by the rank's sequence start.          rounding

    tpdiag compare --model py:tests/models/planted/attn_positions.py:rope_rank_offset --tp 1,2
tests/test_attn_positions.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS, HD, BATCH, SEQ = 32, 16, 4, 4, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _GatherSeq(torch.autograd.Function):
    """The ranks' position slices [B, S/TP, ...] concatenated along dim 1; backward: the sum of
    the ranks' grads of the whole, this rank's slice of it."""

    @staticmethod
    def forward(ctx, t):
        r, n = rank_world()
        ctx.r, ctx.n = r, n
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        s = g.shape[1] // ctx.n
        return g[:, ctx.r * s:(ctx.r + 1) * s]


class _GatherSeqReplicated(torch.autograd.Function):
    """Like _GatherSeq, for a replicated consumer: backward keeps this rank's slice only."""

    @staticmethod
    def forward(ctx, t):
        r, n = rank_world()
        ctx.r, ctx.n = r, n
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        s = g.shape[1] // ctx.n
        return g[:, ctx.r * s:(ctx.r + 1) * s]


def parallel():
    return rank_world()[1] > 1


def reduce(t):
    return _Reduce.apply(t) if parallel() else t


def copy(t):
    return _Copy.apply(t) if parallel() else t


def sum_grad(p):
    def hook(g):
        if parallel():
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


def rotate(x, pos):
    """Rotary embedding of x [B, H, S, HD] at the positions pos [S]."""
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    ang = pos.to(torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class HeadParallelAttention(nn.Module):
    def __init__(self, rank_offset: bool):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3, HEADS * HD, DIM) / DIM ** 0.5)
        self.out = nn.Parameter(torch.randn(DIM, HEADS * HD) / (HEADS * HD) ** 0.5)
        sum_grad(self.qkv)
        sum_grad(self.out)
        self.rank_offset = rank_offset

    def forward(self, x):
        r, n = rank_world()
        B, S, _ = x.shape
        h = HEADS // n
        rows = slice(r * h * HD, (r + 1) * h * HD)
        xi = copy(x)
        q, k, v = (F.linear(xi, w[rows]).view(B, S, h, HD).transpose(1, 2) for w in self.qkv)
        # the mistake: the sequence-parallel start of this rank, though the sequence is whole here
        pos = torch.arange(S) + (r * S // n if self.rank_offset else 0)
        q, k = rotate(q, pos), rotate(k, pos)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + reduce(o.transpose(1, 2).flatten(2) @ self.out[:, rows].t())


class ContextParallelAttention(nn.Module):
    def __init__(self, local_mask: bool):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3, HEADS * HD, DIM) / DIM ** 0.5)
        self.out = nn.Parameter(torch.randn(DIM, HEADS * HD) / (HEADS * HD) ** 0.5)
        sum_grad(self.qkv)
        sum_grad(self.out)
        self.local_mask = local_mask

    def forward(self, x):
        r, n = rank_world()
        B, S, _ = x.shape
        s = S // n
        mine = copy(x)[:, r * s:(r + 1) * s]  # this rank's query positions
        q, k, v = (F.linear(mine, w).view(B, s, HEADS, HD).transpose(1, 2) for w in self.qkv)
        if parallel():
            k = _GatherSeq.apply(k.transpose(1, 2)).transpose(1, 2)
            v = _GatherSeq.apply(v.transpose(1, 2)).transpose(1, 2)
        # the mistake: the causal diagonal from the local query index
        diag = 0 if self.local_mask else r * s
        allowed = torch.ones(s, S, dtype=torch.bool).tril(diagonal=diag)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = o.transpose(1, 2).flatten(2) @ self.out.t()
        y = _GatherSeqReplicated.apply(y) if parallel() else y
        return x + y


class PosLM(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = attn
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.attn(self.embed(tokens))))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(attn):
    return tpdiag.Target(model=PosLM(attn), plan={}, vocab_size=VOCAB, inputs=_tokens)


def rope_rank_offset():
    return _target(HeadParallelAttention(rank_offset=True))


def rope_ok():
    return _target(HeadParallelAttention(rank_offset=False))


def cp_mask_local():
    return _target(ContextParallelAttention(local_mask=True))


def cp_ok():
    return _target(ContextParallelAttention(local_mask=False))
