"""HF-style grouped-query attention split by a DTensor plan, the KV projections left out of it
(helper hred14): 4 query heads, 2 KV heads - fewer KV heads than a user wants to split, so
`k_proj` / `v_proj` stay whole on every rank (replicated) while `q_proj` is `ColwiseParallel()` and
`o_proj` `RowwiseParallel()` (torch's default local outputs). Vocab 32, hidden 32, heads of 8.

  gqa_nrep_local  `repeat_kv`'s group size taken from the tensors at hand
                  (`n_rep = q.shape[1] // k.shape[1]`, as a user writes it to "work at any TP"): at
                  TP=1 4 // 2 = 2, right; at TP=2 a rank's 2 query heads over the 2 whole KV heads
                  give n_rep 1 - query head 1 reads KV head 1 (it belongs to KV head 0), rank 1's
                  query heads 2, 3 read KV heads 0, 1.
  gqa_nrep_nosync the forward fixed: the KV heads expanded with the CONFIG's group size (4 // 2),
                  then the rank's own query heads' slice of them taken. But each rank's grad of the
                  whole `k_proj` / `v_proj` (and of their input) covers its own query heads only,
                  and nothing sums them: the replicas drift at the step.
  gqa_nrep_ok     the twin: as nosync, the k / v projections' output grads summed over the ranks
                  (Megatron's `f` on their outputs: identity forward, all-reduce backward).

    tpdiag compare --model py:tests/models/planted/gqa_nrep.py:gqa_nrep_local --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, HIDDEN, HEADS, KV_HEADS, BATCH, SEQ = 32, 32, 4, 2, 2, 8
HEAD_DIM = HIDDEN // HEADS


def repeat_kv(hidden, n_rep):
    """transformers' repeat_kv: [B, kv, S, d] -> [B, kv * n_rep, S, d]."""
    b, kv, s, d = hidden.shape
    if n_rep == 1:
        return hidden
    return hidden[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class _SumGrad(torch.autograd.Function):
    """Identity forward; each rank's grad covers its own query heads: all-reduce backward."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


def sum_grad(t):
    return _SumGrad.apply(t) if dist.is_initialized() and dist.get_world_size() > 1 else t


class Attention(nn.Module):
    def __init__(self, from_shapes, sync=True):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.from_shapes, self.sync = from_shapes, sync

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k, v = self.k_proj(x), self.v_proj(x)
        if self.sync and not self.from_shapes:
            k, v = sum_grad(k), sum_grad(v)
        k = k.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, -1, HEAD_DIM).transpose(1, 2)
        if self.from_shapes:
            # the mistake: the local query heads over the whole KV heads
            n_rep = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        else:
            rank = dist.get_rank() if dist.is_initialized() else 0
            local = q.shape[1]
            k = repeat_kv(k, HEADS // KV_HEADS)[:, rank * local:(rank + 1) * local]
            v = repeat_kv(v, HEADS // KV_HEADS)[:, rank * local:(rank + 1) * local]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, from_shapes, sync=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.self_attn = Attention(from_shapes, sync)
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        h = h + self.self_attn(h)
        return self.lm_head(self.norm(h))


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}


def _target(from_shapes, sync=True):
    return tpdiag.Target(model=Model(from_shapes, sync), plan=_plan(), vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def gqa_nrep_local():
    return _target(True)


def gqa_nrep_nosync():
    return _target(False, sync=False)


def gqa_nrep_ok():
    return _target(False)
