"""A user's MoE that keeps a per-rank statistic for its logs (helper hleft11): the load-balancing bias
of DeepSeek-V3 (a BUFFER nudged after use, the counts all-reduced first, as balance_bias.py's
global_load), plus `seen`, a BUFFER counting the tokens each expert got - from this rank's own counts,
before their all-reduce. The experts are split over the TP ranks by hand, so each rank's `seen` holds
its own experts' counts only: the replicas differ, but no forward reads `seen` (a logger would).

  logged  the statistic kept and never read: nothing the model computes depends on it
  read    the same statistic, read back: the bias nudged from `seen` (each rank from its own
          experts' counts) - the replicas that differ steer the next step's routing

    tpdiag compare --model py:tests/models/planted/load_stats.py:logged --tp 1,2 --steps 2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, FF, E = 32, 32, 32, 4
B, S = 2, 8
SPEED = 0.05  # the bias update's step (DeepSeek's gamma), large enough to move a top-1 choice


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
    def __init__(self, read_seen):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.register_buffer("bias", torch.zeros(E))
        self.register_buffer("seen", torch.zeros(E))
        self.read_seen = read_seen
        for p in (self.router.weight, self.w1, self.w2):
            sum_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        t = x.reshape(-1, D)
        t = _Copy.apply(t) if n > 1 else t
        scores = torch.sigmoid(self.router(t))
        idx = (scores + self.bias).argmax(-1)       # the bias picks the expert only
        w = scores.gather(1, idx[:, None])
        out = torch.zeros_like(t)
        load = torch.zeros(E, device=t.device)
        for j in range(per):
            e = r * per + j
            sel = idx == e
            load[e] = sel.sum()
            h = F.silu(t[sel] @ self.w1[e].t()) @ self.w2[e].t()
            out = out.index_add(0, sel.nonzero().squeeze(1), h * w[sel])
        if self.training:
            with torch.no_grad():
                self.seen += load  # this rank's experts' counts, for the logs
                if n > 1:
                    dist.all_reduce(load)
                counts = self.seen if self.read_seen else load
                self.bias += SPEED * torch.sign(counts.mean() - counts)
        out = _Reduce.apply(out) if n > 1 else out
        return x + out.view_as(x)


class LM(nn.Module):
    def __init__(self, read_seen):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.moe = MoE(read_seen)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.moe(self.embed(tokens))))


def _target(read_seen):
    t = tpdiag.Target(model=LM(read_seen), plan={}, vocab_size=V,
                      inputs=lambda g: torch.randint(0, V, (B, S), generator=g))
    with torch.no_grad():  # a confident router: no top-1 margin near fp32 rounding on tpdiag's batch
        t.model.moe.router.weight.mul_(4)
    return t


def logged():
    return _target(False)


def read():
    return _target(True)
