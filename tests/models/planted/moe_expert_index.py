"""A user's MoE layer with its experts split over the TP ranks by hand (rank r runs experts
[r E/N, (r+1) E/N) on every token routed there; the ranks' outputs are summed), top-1 routing.
Every rank holds all the experts' weights (one [E, ...] tensor) and indexes them itself.

  bug()   the mistake: rank r indexes the weights with its LOCAL expert number j instead of the
          global r E/N + j, so at TP=2 the tokens routed to experts 2 and 3 run experts 0 and 1
  good()  the global index

In bug() and good() a correct hand-rolled row-parallel MLP runs first, so the first divergence
is its all-reduce (rounding) and the MoE is judged downstream, from its own inputs. In
bug_first() the MoE is the first divergence: the op-level rerun of it cannot record one op
stream (each rank runs its experts on other token counts), so the region is judged at module
level instead (its verdict was left unknown).

The mistake is in the forward and makes no near tie: the router's top-1 margins are far beyond
fp32 rounding, so the float64 re-execution's discrete choice (aten::max) is the one this side
made, and the wrong output is a bug AT the MoE layer (it was named only later, at the router's
backward, as a rank-inconsistent grad).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, FF, E = 64, 32, 64, 4
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
    def __init__(self, local_index):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.local_index = local_index
        for p in (self.router.weight, self.w1, self.w2):
            sum_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        t = x.reshape(-1, D)
        t = _Copy.apply(t) if n > 1 else t
        w, idx = self.router(t).softmax(-1).max(-1)
        out = torch.zeros_like(t)
        for j in range(per):
            e = r * per + j
            sel = idx == e
            k = j if self.local_index else e
            h = F.silu(t[sel] @ self.w1[k].t()) @ self.w2[k].t()
            out = out.index_add(0, sel.nonzero().squeeze(1), h * w[sel, None])
        out = _Reduce.apply(out) if n > 1 else out
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
    def __init__(self, local_index, mlp=True):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mlp = MLP() if mlp else nn.Identity()
        self.moe = MoE(local_index)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.moe(self.mlp(self.embed(tokens)))))


def _target(local_index, mlp=True):
    return tpdiag.Target(model=LM(local_index, mlp), plan={}, vocab_size=V,
                         inputs=lambda g: torch.randint(0, V, (B, S), generator=g))


def bug():
    return _target(True)


def good():
    return _target(False)


def bug_first():
    t = _target(True, mlp=False)
    with torch.no_grad():  # a confident router (no top-1 margin near fp32 rounding on tpdiag's batch)
        t.model.moe.router.weight.mul_(4)
    return t
