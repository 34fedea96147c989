"""Context parallelism written by hand over the TP group (helper hred14): each rank keeps its
slice of the positions from the embedding on, projects its own queries, keys and values (the
weights whole on every rank, their grads summed over the ranks by a hook, as a data-parallel-like
replica), all-gathers the keys and values of every position and attends its queries to them
(causal). The positions are gathered again before the replicated head. Vocab 32, hidden 32, 4
heads of 8, seq 8.

  cp_is_causal  `F.scaled_dot_product_attention(q, k, v, is_causal=True)` with the rank's 4
                queries against all 8 keys: SDPA aligns a non-square causal mask to the TOP-LEFT
                (query i sees keys 0..i), so rank 0 is right and rank 1's queries (positions
                4..7) see keys 0..3 of their own local index - at TP=1 the mask is square.
  cp_offset     the twin: an explicit mask, query at position r * S / TP + i sees keys up to it.

    tpdiag compare --model py:tests/models/planted/context_parallel.py:cp_is_causal --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS, BATCH, SEQ = 32, 32, 4, 2, 8
HEAD_DIM = DIM // HEADS


def cp_rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _my_positions(t):
    r, n = cp_rank_world()
    s = t.shape[1] // n
    return t[:, r * s:(r + 1) * s].contiguous()


def _gather_positions(t):
    parts = [torch.empty_like(t) for _ in range(cp_rank_world()[1])]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 1)


class _Split(torch.autograd.Function):
    """Into the context-parallel region; backward all-gathers the positions' grads."""

    @staticmethod
    def forward(ctx, x):
        return _my_positions(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_positions(g)


class _GatherKV(torch.autograd.Function):
    """Every position's keys/values; each rank's grad of them covers its own queries: backward sums
    them over the ranks and keeps this rank's positions."""

    @staticmethod
    def forward(ctx, x):
        return _gather_positions(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return _my_positions(g)


class _GatherOut(torch.autograd.Function):
    """Out of the region before the replicated head: every rank's grad is the whole one."""

    @staticmethod
    def forward(ctx, x):
        return _gather_positions(x)

    @staticmethod
    def backward(ctx, g):
        return _my_positions(g)


def _cp(fn, x):
    return fn.apply(x) if cp_rank_world()[1] > 1 else x


def replica_grads_summed(module):
    for p in module.parameters():
        p.register_hook(lambda g: _summed(g))


def _summed(g):
    if cp_rank_world()[1] > 1:
        g = g.clone()
        dist.all_reduce(g)
    return g


class CPAttention(nn.Module):
    def __init__(self, explicit_mask):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.explicit_mask = explicit_mask

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = _cp(_GatherKV, self.wk(x)).view(b, -1, HEADS, HEAD_DIM).transpose(1, 2)
        v = _cp(_GatherKV, self.wv(x)).view(b, -1, HEADS, HEAD_DIM).transpose(1, 2)
        if self.explicit_mask:
            r, _ = cp_rank_world()
            qpos = torch.arange(r * s, (r + 1) * s).unsqueeze(1)
            mask = torch.arange(k.shape[2]).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            # the mistake: is_causal with fewer queries than keys is top-left aligned
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, DIM))


class CPLM(nn.Module):
    def __init__(self, explicit_mask):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.attn = CPAttention(explicit_mask)
        self.norm_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        for m in (self.norm, self.attn):
            replica_grads_summed(m)  # each rank's grads cover its own positions

    def forward(self, tokens):
        x = _cp(_Split, self.embed(tokens))
        x = x + self.attn(self.norm(x))
        return self.head(self.norm_f(_cp(_GatherOut, x)))


def _target(explicit_mask):
    return tpdiag.Target(model=CPLM(explicit_mask), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def cp_is_causal():
    return _target(False)


def cp_offset():
    return _target(True)
