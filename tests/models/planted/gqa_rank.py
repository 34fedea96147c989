"""Grouped-query attention with fewer KV heads than the TP degree, written by hand (helper hbug12):
4 query heads split by rank (`wq` rows, `wo` columns, Megatron-style), 2 KV heads whose `wk`/`wv`
are held WHOLE on every rank (replicated: at TP=4 two ranks share each KV head), each rank picking
the KV head its query heads attend to. Vocab 32, hidden 32, heads of 8.

  gqa_rank_mod  the rank picks KV head `rank % n_kv` ("rank r owns KV head r", wrapped): right at
                TP=2 (one KV head per rank), wrong at TP=4 - ranks 1 and 2 attend with each
                other's KV head (query head g belongs to KV head g // (n_heads / n_kv)).
  gqa_rank_mod_deep  the same after a correct GQA block (`first`): the mistake's inputs already
                differ from TP=1's by rounding
  gqa_ok        the twin (gqa_ok_deep: after the correct block): the KV head of the rank's first query head.

    tpdiag compare --model py:tests/models/planted/gqa_rank.py:gqa_rank_mod --tp 1,2,4
tests/test_gqa_rank.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS, KV, BATCH, SEQ = 32, 32, 4, 2, 2, 8
HD = DIM // HEADS


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    """Identity forward; the ranks' grads are partial sums: all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


class GQA(nn.Module):
    def __init__(self, wrap_by_rank):
        super().__init__()
        r, n = rank_world()
        self.local_heads = HEADS // n
        wq, wo = torch.randn(DIM, DIM) / DIM ** 0.5, torch.randn(DIM, DIM) / DIM ** 0.5
        rows = slice(r * self.local_heads * HD, (r + 1) * self.local_heads * HD)
        self.wq = nn.Parameter(wq[rows].clone())
        self.wk = nn.Parameter(torch.randn(KV * HD, DIM) / DIM ** 0.5)
        self.wv = nn.Parameter(torch.randn(KV * HD, DIM) / DIM ** 0.5)
        self.wo = nn.Parameter(wo[:, rows].clone())
        self.wrap_by_rank = wrap_by_rank

    def _kv_heads(self):
        r, n = rank_world()
        if n <= KV:  # each rank holds whole KV groups
            per = KV // n
            return list(range(r * per, (r + 1) * per))
        # the mistake (wrap_by_rank): "rank r owns KV head r", wrapped round
        first_q = r * self.local_heads
        return [r % KV] if self.wrap_by_rank else [first_q // (HEADS // KV)]

    def forward(self, x):
        b, s, _ = x.shape
        xc = copy(x)
        q = F.linear(xc, self.wq).view(b, s, self.local_heads, HD).transpose(1, 2)
        k = F.linear(xc, copy(self.wk)).view(b, s, KV, HD).transpose(1, 2)
        v = F.linear(xc, copy(self.wv)).view(b, s, KV, HD).transpose(1, 2)
        pick = self._kv_heads()
        k, v = k[:, pick], v[:, pick]
        rep = self.local_heads // len(pick)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = F.linear(y.transpose(1, 2).reshape(b, s, -1), self.wo)
        return _Reduce.apply(out) if rank_world()[1] > 1 else out


class LM(nn.Module):
    def __init__(self, wrap_by_rank, deep):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        # deep: a correct block first, whose all-reduce already rounds otherwise than TP=1's
        self.first = GQA(False) if deep else None
        self.attn = GQA(wrap_by_rank)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.first is not None:
            h = h + self.first(h)
        return self.head(self.norm(h + self.attn(h)))


def _target(wrap_by_rank, deep=False):
    return tpdiag.Target(model=LM(wrap_by_rank, deep), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def gqa_rank_mod():
    return _target(True)


def gqa_rank_mod_deep():
    return _target(True, deep=True)


def gqa_ok_deep():
    return _target(False, deep=True)


def gqa_ok():
    return _target(False)
