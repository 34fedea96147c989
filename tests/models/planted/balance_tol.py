"""A user's MoE with DeepSeek-V3's auxiliary-loss-free load balancing, nudged only past a TOLERANCE
(helper hreview10; tests/models/planted/balance_bias.py's layer otherwise): top-1 routing picks
argmax(score + bias), `bias` a BUFFER the training forward nudges after use - experts that got more
than the mean load pushed down, the others up - but only where the loads' spread exceeds 4 tokens
(the Python `if` a user writes to leave a balanced router alone). The experts are split over the TP
ranks by hand (rank r runs experts [r E/N, (r+1) E/N) on the tokens routed there, the ranks' outputs
summed), each rank holding every expert's weights and summing the grads.

  local_load  the mistake: each rank counts the load of ITS OWN experts only (the others' counts
              left 0) - the all-reduce of the counts forgotten - so each rank decides on its own
              whether to nudge: at TP=2 one rank writes the bias and the other does not
  global_load the twin: the counts all-reduced over the ranks first (every rank decides alike)

    tpdiag compare --model py:tests/models/planted/balance_tol.py:local_load --tp 1,2 --steps 2
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
    def __init__(self, reduce_load):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.register_buffer("bias", torch.zeros(E))
        self.reduce_load = reduce_load
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
                if self.reduce_load and n > 1:
                    dist.all_reduce(load)
                if float(load.max() - load.min()) > 4:  # only when the imbalance passes a tolerance
                    self.bias += SPEED * torch.sign(load.mean() - load)
        out = _Reduce.apply(out) if n > 1 else out
        return x + out.view_as(x)


class LM(nn.Module):
    def __init__(self, reduce_load):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.moe = MoE(reduce_load)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.moe(self.embed(tokens))))


def _target(reduce_load):
    t = tpdiag.Target(model=LM(reduce_load), plan={}, vocab_size=V,
                      inputs=lambda g: torch.randint(0, V, (B, S), generator=g))
    with torch.no_grad():  # a confident router: no top-1 margin near fp32 rounding on tpdiag's batch
        t.model.moe.router.weight.mul_(4)
    return t


def local_load():
    return _target(False)


def global_load():
    return _target(True)
