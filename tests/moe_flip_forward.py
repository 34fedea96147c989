"""A user's top-2 MoE in bfloat16, split over the TP ranks by hand, FOLLOWED by a hand-rolled row-parallel
MLP with a bias. A row-parallel MLP before the MoE moves the router's input by a rounding at TP=2, and one
token's router scores nearly tie right there: token 3 picks another expert at TP=2 (router-flip, rounding).
That token's row differs from the reference's beyond any rounding bound from there on - but only its row:
no op after the MoE mixes tokens.

  moe_flip_ok()        CORRECT: the MLP after the MoE adds its bias once, after the all-reduce
  moe_flip_bias_bug()  the twin: every rank adds the (replicated) bias to its partial BEFORE the
                       all-reduce, so at TP=2 it is counted twice - on EVERY token row, the 15 rows the
                       flip left alone too

    tpdiag compare --model py:tests/moe_flip_forward.py:moe_flip_bias_bug --tp 1,2 --dtype bfloat16 --forward-only
On bedbdc47 the twin's wrong MLP output read `router-flip` (it comes after the flip), the run `rounding only`,
gate --allow rounding 0; now `sharding-bug`, gate 4 (tests/test_moe_flip_forward.py). With the backward the router
logits grad's shares catch it anyway (diff/flip_shares.py), so the test runs forward only. The near tie is placed for bfloat16 as in tests/moe_token_mixer.py.
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
    """The row-parallel all-reduce: sum forward, the grad passed through (every rank holds it)."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Enter(torch.autograd.Function):
    """Where a column-parallel part starts: identity forward, the ranks' input grads summed backward."""

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


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E)

    def forward(self, t):
        z = self.proj(t)
        return z, z.topk(K, -1).indices


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.w_in = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w_out = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        for p in (self.router.proj.weight, self.router.proj.bias, self.w_in, self.w_out):
            summed_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        flat = x.reshape(-1, D)
        t = _Enter.apply(flat) if n > 1 else flat
        z, idx = self.router(t)
        w = z.softmax(-1).gather(-1, idx)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        for j in range(per):
            e = r * per + j
            tok, slot = (idx == e).nonzero(as_tuple=True)
            h = F.silu(t[tok] @ self.w_in[e].t()) @ self.w_out[e].t()
            out = out.index_add(0, tok, h * w[tok, slot, None])
        out = _Sum.apply(out) if n > 1 else out
        return x + out.view_as(x)


class MLP(nn.Module):
    def __init__(self, bias_every_rank=False):
        super().__init__()
        self.fc = nn.Parameter(torch.randn(FF, D) / D ** 0.5)
        self.proj = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        self.bias = nn.Parameter(torch.randn(D) * 0.5)
        self.bias_every_rank = bias_every_rank
        summed_grad(self.fc)
        summed_grad(self.proj)

    def partial(self, x, r, n):
        cols = slice(r * FF // n, (r + 1) * FF // n)
        return F.gelu(x @ self.fc[cols].t()) @ self.proj[:, cols].t()

    def forward(self, x):
        r, n = world()
        t = _Enter.apply(x) if n > 1 else x
        h = self.partial(t, r, n)
        if n == 1:
            return x + h + self.bias
        if self.bias_every_rank:
            # the mistake: the replicated bias added to each rank's partial, then summed - N times at TP=N
            return x + _Sum.apply(h + self.bias)
        return x + _Sum.apply(h) + self.bias


class LM(nn.Module):
    def __init__(self, late_bug):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.mlp = MLP()
        self.moe = MoE()
        self.mlp2 = MLP(bias_every_rank=late_bug)
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.out(self.ln(self.mlp2(self.moe(self.mlp(self.tok(tokens))))))


def _tokens(g):
    return torch.arange(B * S).reshape(B, S) * 7 % V  # fixed: the near tie is placed for it


def _place_tie(model: LM) -> None:
    """Expert 0 scores the router input's feature j, expert 1 a constant m strictly between its
    TP=1 and TP=2 values for one token (bf16, the MLP's two partials added as the all-reduce adds
    them, its bias after); expert 2 always first, expert 3 always last: the second place is the contest."""
    bf = torch.bfloat16
    with torch.no_grad():
        x = model.tok.weight.to(bf)[_tokens(None)].reshape(-1, D)
        mlp = MLP()
        mlp.load_state_dict(model.mlp.state_dict())
        mlp = mlp.to(bf)
        h1 = x + mlp.partial(x, 0, 1) + mlp.bias
        h2 = x + (mlp.partial(x, 0, 2) + mlp.partial(x, 1, 2)) + mlp.bias
        steps = (h1.float() - h2.float()).abs() / (h1.float().abs() * 2 ** -8).clamp_min(1e-30)
        flat = int(steps.flatten().argmax())
        tok, j = divmod(flat, D)
        lo, hi = sorted((h1[tok, j], h2[tok, j]))
        mid = ((lo.float() + hi.float()) / 2).to(bf)
        if not (lo < mid < hi):
            raise RuntimeError("no bf16 value between the TP=1 and TP=2 router inputs: change the sizes")
        col = torch.cat([h1[:, j], h2[:, j]]).float()
        p = model.moe.router.proj
        p.weight.zero_()
        p.weight[0, j] = 1.0
        p.bias.copy_(torch.tensor([0.0, float(mid), float(col.max()) + 1.0, float(col.min()) - 10.0]))


def _target(late_bug):
    model = LM(late_bug)
    _place_tie(model)
    return tpdiag.Target(model=model, plan={}, vocab_size=V, inputs=_tokens)


def moe_flip_ok():
    return _target(False)


def moe_flip_bias_bug():
    return _target(True)
