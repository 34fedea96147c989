"""A user's Mixtral-style MoE block after a hand-rolled row-parallel MLP (helper hdisc17): top-2
routing whose indices pick the experts, the experts split over the TP ranks by hand (rank r runs
experts [r E/N, (r+1) E/N) on the tokens routed there; the ranks' outputs are summed), plus one
shared expert every token runs. The router is freshly initialised small (scores near ties), so its
top-2 choice is no clear one: fp32 rounding could order two experts either way.

  shared_every_rank()  the mistake: every rank adds the (replicated) shared expert's output to its
                       partial BEFORE the all-reduce, so at TP=N it is counted N times
  shared_once()        the twin: the shared expert added once, after the all-reduce

The first divergence is the MLP's all-reduce (rounding); the MoE is judged downstream, on its own
inputs, and its float64 re-execution makes a discrete choice (aten::topk) that this run cannot
show was flipped by rounding (no router-flip, the choices not recorded equal).

    tpdiag compare --model py:tests/models/planted/moe_late_bug.py:shared_every_rank --tp 1,2
tests/test_moe_late_bug.py.
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
        g = g.contiguous()
        dist.all_reduce(g)
        return g


def sum_grad(p):
    def hook(g):
        if world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class MoE(nn.Module):
    def __init__(self, shared_before_reduce):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        nn.init.normal_(self.router.weight, std=1e-4)  # a fresh router: its scores near ties
        self.w1 = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.s1 = nn.Parameter(torch.randn(FF, D) / D ** 0.5)
        self.s2 = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        self.shared_before_reduce = shared_before_reduce
        for p in (self.router.weight, self.w1, self.w2):
            sum_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        flat = x.reshape(-1, D)
        t = _Copy.apply(flat) if n > 1 else flat
        w, idx = self.router(t).softmax(-1).topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        for j in range(per):
            e = r * per + j
            tok, slot = (idx == e).nonzero(as_tuple=True)
            h = F.silu(t[tok] @ self.w1[e].t()) @ self.w2[e].t()
            out = out.index_add(0, tok, h * w[tok, slot, None])
        # the shared expert reads the tokens before _Copy: its input grad is whole on every rank, and
        # _Copy's all-reduce would count it N times (moe_bwd_bug.py's mistake, in the backward only)
        shared = F.silu(flat @ self.s1.t()) @ self.s2.t()
        if self.shared_before_reduce:
            out = out + shared  # the mistake: on every rank, then summed over the ranks
        out = _Reduce.apply(out) if n > 1 else out
        if not self.shared_before_reduce:
            out = out + shared
        return x + out.view_as(x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(FF, D) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)

    def forward(self, x):
        r, n = world()
        cols = slice(r * FF // n, (r + 1) * FF // n)
        h = F.gelu((_Copy.apply(x) if n > 1 else x) @ self.up[cols].t()) @ self.down[:, cols].t()
        return x + (_Reduce.apply(h) if n > 1 else h)


class LM(nn.Module):
    def __init__(self, shared_before_reduce):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mlp = MLP()
        self.moe = MoE(shared_before_reduce)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.moe(self.mlp(self.embed(tokens)))))


def _target(shared_before_reduce):
    return tpdiag.Target(model=LM(shared_before_reduce), plan={}, vocab_size=V,
                         inputs=lambda g: torch.randint(0, V, (B, S), generator=g))


def shared_every_rank():
    return _target(True)


def shared_once():
    return _target(False)
