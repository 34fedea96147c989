"""The per-rank statistic of load_stats.py:read (each rank's `seen` from its own experts' counts,
read back to nudge the routing bias), but kept where many users keep such state: in a small
module of its own (`moe.balance`, never called - a holder of buffers) rather than on the MoE
module that reads and writes it (helper hreview11). The replicas of `balance.seen` and
`balance.bias` differ across the ranks after step 0, and step 1's routing reads them.

  held_elsewhere  a BUG (the next step's routing differs across the ranks)
  held_logged     the twin: `seen` kept for the logs, never read (the bias from the all-reduced counts)
  held_backward   `seen` read in the backward only: the MoE's output grad is damped by the tokens seen so
                  far (a custom autograd function; the bias from the all-reduced counts): a BUG, its
                  forward bitwise at every step

    tpdiag compare --model py:tests/models/planted/stats_elsewhere.py:held_elsewhere --tp 1,2 --steps 2
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


class Balance(nn.Module):
    """Holds the balancing state; MoE reads and writes it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.zeros(E))
        self.register_buffer("seen", torch.zeros(E))


class _Damp(torch.autograd.Function):
    """Identity forward; the grad damped by the tokens `seen` so far (read in the backward only)."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.save_for_backward(seen.clone())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        seen, = ctx.saved_tensors
        return g / (1.0 + 1e-3 * seen.sum()), None


class MoE(nn.Module):
    def __init__(self, read_seen, damp=False):
        super().__init__()
        self.damp = damp
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.balance = Balance()
        self.read_seen = read_seen
        for p in (self.router.weight, self.w1, self.w2):
            sum_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        t = x.reshape(-1, D)
        t = _Copy.apply(t) if n > 1 else t
        if self.damp:
            t = _Damp.apply(t, self.balance.seen)
        scores = torch.sigmoid(self.router(t))
        idx = (scores + self.balance.bias).argmax(-1)       # the bias picks the expert only
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
                self.balance.seen += load  # this rank's experts' counts, for the logs
                if n > 1:
                    dist.all_reduce(load)
                counts = self.balance.seen if self.read_seen else load
                self.balance.bias += SPEED * torch.sign(counts.mean() - counts)
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


def held_backward():
    t = _target(False)
    t.model.moe.damp = True
    return t


def held_logged():
    return _target(False)


def held_elsewhere():
    return _target(True)
