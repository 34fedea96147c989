"""A user's MoE with its experts split over the TP ranks by hand (rank r runs experts [r E/N, (r+1) E/N)
on every token routed there; the ranks' outputs summed), top-1 routing, every rank holding all the
experts' weights (helper hbug10). The layer's output is accumulated IN PLACE into a buffer it makes
with `torch.zeros(tokens, D)` - no dtype given (the default float32) - `out.index_add_(...)` per expert.

  local_index  the mistake: rank r indexes the weights with its LOCAL expert number j instead of the
               global r E/N + j (as moe_expert_index.py:bug_first), so at TP=2 the tokens routed to
               experts 2 and 3 run experts 0 and 1
  global_index the twin

    tpdiag compare --model py:tests/models/planted/moe_accum.py:local_index --tp 1,2
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
            sum_grad(p)

    def forward(self, x):
        r, n = world()
        per = E // n
        t = x.reshape(-1, D)
        t = _Copy.apply(t) if n > 1 else t
        w, idx = self.router(t).softmax(-1).max(-1)
        out = torch.zeros(t.shape[0], D, device=t.device)
        for j in range(per):
            e = r * per + j
            sel = (idx == e).nonzero().squeeze(1)
            k = j if self.local_index else e
            h = F.silu(t[sel] @ self.w1[k].t()) @ self.w2[k].t()
            out.index_add_(0, sel, h * w[sel, None])
        out = _Reduce.apply(out) if n > 1 else out
        return x + out.view_as(x)


class LM(nn.Module):
    def __init__(self, local_index):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.moe = MoE(local_index)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.moe(self.embed(tokens))))


def _target(local_index):
    t = tpdiag.Target(model=LM(local_index), plan={}, vocab_size=V,
                      inputs=lambda g: torch.randint(0, V, (B, S), generator=g))
    with torch.no_grad():  # a confident router (no top-1 margin near fp32 rounding on tpdiag's batch)
        t.model.moe.router.weight.mul_(4)
    return t


def local_index():
    return _target(True)


def global_index():
    return _target(False)
