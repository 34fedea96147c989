"""User-written LMs whose verdicts the table and the op-level judge got wrong (helper hbug).

  autocast   a hand-rolled row-parallel MLP run under torch.autocast(bf16) in a float32 model:
             correct (rounding only). TP=1 rounds the down projection's sum to bf16 once; TP=2
             rounds each rank's bf16 partial and the all-reduce rounds their sum again, so the
             float32 residual add after it is a bf16 ULP off - not a bug
  scale_bug  attention split by heads (DTensor plan, local outputs) whose softmax scale comes
             from the LOCAL projection width: (D / TP / H) ** -0.5 instead of (D / H) ** -0.5 -
             a bug, and the first divergence itself (its table row must say BUG)
  rank_seed  a replicated norm weight drawn from a generator seeded by the rank: rank-
             inconsistent from init on (its row must show the spread between the ranks)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, FF, H = 64, 32, 64, 4
B, S = 2, 8


def world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


def reduce(t):
    return _Reduce.apply(t) if world()[1] > 1 else t


def copy(t):
    return _Copy.apply(t) if world()[1] > 1 else t


def sum_grad(p):
    def hook(g):
        if world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class HandMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)
        for p in (self.up.weight, self.up.bias, self.down.weight):
            sum_grad(p)

    def forward(self, x):
        r, n = world()
        cols = slice(r * FF // n, (r + 1) * FF // n)
        h = F.gelu(copy(x) @ self.up.weight[cols].t() + self.up.bias[cols])
        return x + reduce(h @ self.down.weight[:, cols].t()) + self.down.bias


class AutocastLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mlp = HandMLP()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.mlp(h)
        return self.head(self.norm(h.float()))


def _tokens(g):
    return torch.randint(0, V, (B, S), generator=g)


def autocast():
    return tpdiag.Target(model=AutocastLM(), plan={}, vocab_size=V, inputs=_tokens)


class Attn(nn.Module):
    def __init__(self, local_scale):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.local_scale = local_scale

    def forward(self, x):
        b, s, _ = x.shape
        hd = D // H
        q = self.wq(x)
        scale = (q.shape[-1] // H) ** -0.5 if self.local_scale else hd ** -0.5
        q = q.view(b, s, -1, hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class AttnLM(nn.Module):
    def __init__(self, local_scale):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.attn = Attn(local_scale)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.attn(h)))


def _attn_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel()}


def scale_bug():
    return tpdiag.Target(model=AttnLM(True), plan=_attn_plan(), vocab_size=V, inputs=_tokens)


def scale_good():
    return tpdiag.Target(model=AttnLM(False), plan=_attn_plan(), vocab_size=V, inputs=_tokens)


class SeededNorm(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1000 + world()[0])  # the mistake: a seed per rank
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))

    def forward(self, x):
        return F.layer_norm(x, (D,), self.weight)


class SeededLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.norm = SeededNorm()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def rank_seed():
    return tpdiag.Target(model=SeededLM(), plan={}, vocab_size=V, inputs=_tokens)
