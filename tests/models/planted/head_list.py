"""A user's attention written as a LIST of head modules (the nanoGPT-lecture way:
`nn.ModuleList([Head(head_size) for _ in range(n_head)])`, each head its own key/query/value
Linear), split over the TP ranks by hand (helper hplant18): every rank builds all the heads (seeded
alike) and keeps its own `heads[r H/n:(r+1) H/n]` - so rank 1's `heads.0` is the model's head 2 -
and the output projection is row-parallel (its columns for those heads; partial sums all-reduced,
the bias added after). The attention's input goes through Megatron's f. Vocab 32, dim 32, 4 heads
of 8, seq 8.

  heads_split  correct: the same function, the projection's sum reordered.        rounding
  proj_first   the projection keeps columns [0, D/n) on every rank (the first heads' columns,
               whichever heads the rank holds): a wrong result at TP > 1.          BUG

    tpdiag compare --model py:tests/models/planted/head_list.py:heads_split --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS, BATCH, SEQ = 32, 32, 4, 2, 8
HEAD_SIZE = DIM // HEADS


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.key = nn.Linear(DIM, HEAD_SIZE, bias=False)
        self.query = nn.Linear(DIM, HEAD_SIZE, bias=False)
        self.value = nn.Linear(DIM, HEAD_SIZE, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(SEQ, SEQ)))

    def forward(self, x):
        _, t, _ = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * HEAD_SIZE ** -0.5
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf")).softmax(-1)
        return wei @ self.value(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, proj_first):
        super().__init__()
        r, n = rank_world()
        per = HEADS // n
        heads = [Head() for _ in range(HEADS)]
        self.heads = nn.ModuleList(heads[r * per:(r + 1) * per])
        proj = nn.Linear(DIM, DIM)
        cols = (0 if proj_first else r) * per * HEAD_SIZE
        self.proj_weight = nn.Parameter(proj.weight[:, cols:cols + per * HEAD_SIZE].detach().clone())
        self.proj_bias = nn.Parameter(proj.bias.detach().clone())

    def forward(self, x):
        n = rank_world()[1]
        x = _Copy.apply(x) if n > 1 else x
        out = F.linear(torch.cat([h(x) for h in self.heads], dim=-1), self.proj_weight)
        return (_Reduce.apply(out) if n > 1 else out) + self.proj_bias


class LM(nn.Module):
    def __init__(self, proj_first):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, DIM)
        self.ln1 = nn.LayerNorm(DIM)
        self.sa = MultiHeadAttention(proj_first)
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.token_embedding(idx)
        x = x + self.sa(self.ln1(x))
        return self.lm_head(self.ln_f(x))


def _target(proj_first):
    return tpdiag.Target(model=LM(proj_first), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def heads_split():
    return _target(False)


def proj_first():
    return _target(True)
