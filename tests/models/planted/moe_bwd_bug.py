"""A user's top-2 MoE block after a hand-rolled row-parallel MLP (helper hbwd18), whose mistake is in
the BACKWARD only: the routed experts are split over the TP ranks by hand (rank r runs experts
[r E/N, (r+1) E/N) on the tokens routed there; the ranks' outputs are summed), the tokens enter them
through `_Enter` (identity forward, all-reduce of the input grad backward: each rank's grad covers
its own experts), and one shared expert runs on every rank, added after the all-reduce. The router
is freshly initialised small (scores near ties), so its top-2 choice is no clear one.

  shared_through_enter()  the mistake: the shared expert reads the tokens AFTER `_Enter`, so its input
                          grad (already whole on every rank) is all-reduced with the experts' partial
                          grads - counted N times at TP=N. The forward is exactly right.
  shared_beside()         the twin: the shared expert reads the tokens before `_Enter`

The first divergence is the MLP's all-reduce (rounding); the MoE's forward past it is right; the MLP's
output grad (the MoE's input grad) is wrong at TP=2 in the first variant only.

    tpdiag compare --model py:tests/models/planted/moe_bwd_bug.py:shared_through_enter --tp 1,2
tests/test_moe_bwd_bug.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, FF, E, K = 64, 32, 64, 4, 2
B, S = 2, 8


def world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


def summed_grad(p):
    def hook(g):
        if world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class SparseBlock(nn.Module):
    def __init__(self, shared_after_enter):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        nn.init.normal_(self.router.weight, std=1e-4)  # fresh: its scores near ties
        self.w_in = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w_out = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.shared_in = nn.Parameter(torch.randn(FF, D) / D ** 0.5)
        self.shared_out = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        self.shared_after_enter = shared_after_enter
        for p in (self.router.weight, self.w_in, self.w_out):
            summed_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        flat = x.reshape(-1, D)
        t = _Enter.apply(flat) if n > 1 else flat
        w, idx = self.router(t).softmax(-1).topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        for j in range(per):
            e = r * per + j
            tok, slot = (idx == e).nonzero(as_tuple=True)
            h = F.silu(t[tok] @ self.w_in[e].t()) @ self.w_out[e].t()
            out = out.index_add(0, tok, h * w[tok, slot, None])
        out = _Sum.apply(out) if n > 1 else out
        s = t if self.shared_after_enter else flat  # the mistake: t's grad is all-reduced
        out = out + F.silu(s @ self.shared_in.t()) @ self.shared_out.t()
        return x + out.view_as(x)


class DenseMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Parameter(torch.randn(FF, D) / D ** 0.5)
        self.proj = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        summed_grad(self.fc)
        summed_grad(self.proj)

    def forward(self, x):
        r, n = world()
        cols = slice(r * FF // n, (r + 1) * FF // n)
        h = F.gelu((_Enter.apply(x) if n > 1 else x) @ self.fc[cols].t()) @ self.proj[:, cols].t()
        return x + (_Sum.apply(h) if n > 1 else h)


class TinyLM(nn.Module):
    def __init__(self, shared_after_enter):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.dense = DenseMLP()
        self.sparse = SparseBlock(shared_after_enter)
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.out(self.ln(self.sparse(self.dense(self.tok(tokens)))))


def _target(shared_after_enter):
    return tpdiag.Target(model=TinyLM(shared_after_enter), plan={}, vocab_size=V,
                         inputs=lambda g: torch.randint(0, V, (B, S), generator=g))


def shared_through_enter():
    return _target(True)


def shared_beside():
    return _target(False)
