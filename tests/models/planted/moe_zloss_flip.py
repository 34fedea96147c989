"""A user's top-2 MoE in bfloat16 after a hand-rolled row-parallel MLP, with a router z-loss added in
the backward as Megatron adds its aux losses (an autograd function: identity forward, the loss's grad
added to the logits' grad backward). The routed experts are split over the TP ranks by hand (rank r
runs experts [r E/N, (r+1) E/N) on its tokens; the ranks' outputs summed), the tokens enter them
through `_Enter` (identity forward, all-reduce of the input grad backward: each rank's logits grad
covers its own experts, a share of the whole). The router (module `router`, returning its logits
and its integer top-2) nearly ties for one token right where TP=2's reduction moves the router's
input: the expert choice flips at TP=2 (router-flip, rounding), and the router's logits grad - a
softmax backward whose terms cancel - is judged downstream of that flip.

  zloss_every_rank()  the mistake: every rank adds the whole z-loss grad to its share of the logits
                      grad, and `_Enter` sums the shares: the z-loss counts N times at TP=N, inside
                      the bf16 share band (diff/partials.near_shares)
  zloss_share()       the twin: each rank adds 1/N of it (the shares add up to one z-loss)

What it shows (bf16, --tp 1,2, no baseline, no confirmation): router-flip at `moe.router` (out 1, token
3), then `unknown` at `moe.router.proj` (grad_out 0) for BOTH twins, gate 1: the flipped token's row is
no share of the reference's, so the share tests run on the other 15 rows (diff/flip_shares.py), which
add up only within the bf16 share band - 7.6e-05 off for the twin, 2.9e-04 for the mistake, the band
4.3e-04 (tests/test_flip_shares.py). With the tie moved away (no flip) both read `unknown` there
(class unknown).

    tpdiag compare --model py:tests/models/planted/moe_zloss_flip.py:zloss_share --tp 1,2 --dtype bfloat16
The near tie is placed for bfloat16 (the TP=2 value of the router's input emulated here in bf16, as
the ranks compute it).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, FF, E, K = 64, 32, 64, 4, 2
B, S = 2, 8
ZLOSS = 1e-3


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


class _AddZLoss(torch.autograd.Function):
    """Identity forward; backward adds scale * d(mean_t logsumexp(z_t)^2)/dz to the logits' grad."""

    @staticmethod
    def forward(ctx, z, scale):
        ctx.save_for_backward(z)
        ctx.scale = scale
        return z.view_as(z)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        zf = z.float()
        lse = zf.logsumexp(-1, keepdim=True)
        extra = ctx.scale * 2 * lse * zf.softmax(-1) / zf.shape[0]
        return g + extra.to(g.dtype), None


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
    def __init__(self, zloss_share):
        super().__init__()
        self.router = Router()
        self.w_in = nn.Parameter(torch.randn(E, FF, D) / D ** 0.5)
        self.w_out = nn.Parameter(torch.randn(E, D, FF) / FF ** 0.5)
        self.zloss_share = zloss_share
        for p in (self.router.proj.weight, self.router.proj.bias, self.w_in, self.w_out):
            summed_grad(p)  # each rank's grad covers its experts' tokens only

    def forward(self, x):
        r, n = world()
        per = E // n
        flat = x.reshape(-1, D)
        t = _Enter.apply(flat) if n > 1 else flat
        z, idx = self.router(t)
        z = _AddZLoss.apply(z, ZLOSS / n if self.zloss_share else ZLOSS)
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
    def __init__(self):
        super().__init__()
        self.fc = nn.Parameter(torch.randn(FF, D) / D ** 0.5)
        self.proj = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        summed_grad(self.fc)
        summed_grad(self.proj)

    def partial(self, x, r, n):
        cols = slice(r * FF // n, (r + 1) * FF // n)
        return F.gelu(x @ self.fc[cols].t()) @ self.proj[:, cols].t()

    def forward(self, x):
        r, n = world()
        h = self.partial(_Enter.apply(x) if n > 1 else x, r, n)
        return x + (_Sum.apply(h) if n > 1 else h)


class LM(nn.Module):
    def __init__(self, zloss_share):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.mlp = MLP()
        self.moe = MoE(zloss_share)
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        return self.out(self.ln(self.moe(self.mlp(self.tok(tokens)))))


def _tokens(g):
    return torch.arange(B * S).reshape(B, S) * 7 % V  # fixed: the near tie is placed for it


def _place_tie(model: LM) -> None:
    """Expert 0 scores the router input's feature j, expert 1 a constant m strictly between its
    TP=1 and TP=2 values for one token (bf16, the MLP's two partials added as the all-reduce adds
    them); expert 2 always first, expert 3 always last: the second place is the contest."""
    bf = torch.bfloat16
    with torch.no_grad():
        x = model.tok.weight.to(bf)[_tokens(None)].reshape(-1, D)
        mlp = MLP()
        mlp.load_state_dict(model.mlp.state_dict())
        mlp = mlp.to(bf)
        h1 = x + mlp.partial(x, 0, 1)
        h2 = x + (mlp.partial(x, 0, 2) + mlp.partial(x, 1, 2))
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


def _target(zloss_share):
    model = LM(zloss_share)
    _place_tie(model)
    return tpdiag.Target(model=model, plan={}, vocab_size=V, inputs=_tokens)


def zloss_every_rank():
    return _target(False)


def zloss_share():
    return _target(True)
