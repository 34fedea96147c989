"""A user's TP mistake that only the second step's BACKWARD shows, beside its correct twin. Every rank
holds only its SHARD of the MLP's weights (plain tensors sliced from a master drawn whole); the
collectives are written with torch.distributed. Vocab 32, hidden 32, seq 8.

  stale_grad / fresh_grad  the model's own code guards the residual stream's grad at TP > 1: identity
               forward, the grad averaged over the ranks in backward (every rank's copy the same) -
               and the averaged grad memoised for a recomputed backward. The mistake: the memo is
               keyed by the grad's shape alone, so the second step's backward returns the FIRST
               step's grad - at TP=1 there is no guard. Step 0 is right, and every forward; step 1's
               grads from the residual stream down (mlp's output grad, the MLP's and the embedding's
               weight grads) are step 0's. Twin: the memo keyed by the grad tensor itself.
  stale_grad_drop / fresh_grad_drop  the same with dropout on the residual stream: the model's own
               code draws random numbers, so its float64 backward (which judges mlp's output grad,
               made by that code) is refused and the grad is left not judged.

    tpdiag compare --model py:tests/models/planted/step_stale_grad.py:stale_grad_drop --tp 1,2 --steps 2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class Reduce(nn.Module):
    def forward(self, partial):
        return _Reduce.apply(partial) if rank_world()[1] > 1 else partial


class _SyncGrad(torch.autograd.Function):
    """Identity forward; in backward the replicated grad averaged over the ranks (the user's guard
    that every rank's copy agrees), the synced grad memoised for a recomputed backward."""

    @staticmethod
    def forward(ctx, t, memo, by_shape_only):
        ctx.memo, ctx.by_shape_only = memo, by_shape_only
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        seen = ctx.memo.get("in")
        if seen is not None and (seen.shape == g.shape if ctx.by_shape_only else seen is g):
            return ctx.memo["out"], None, None
        out = g.contiguous().clone()
        dist.all_reduce(out)
        out = out / dist.get_world_size()
        ctx.memo.update({"in": g, "out": out})  # the grad held: a new one is never taken for it
        return out, None, None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))
        self.reduce = Reduce()

    def forward(self, x):
        xc = _Copy.apply(x) if rank_world()[1] > 1 else x
        return self.reduce(F.gelu(xc @ self.up.t()) @ self.down.t())


class LM(nn.Module):
    def __init__(self, by_shape_only, p_drop):
        super().__init__()
        self.drop = nn.Dropout(p_drop)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP()
        self.by_shape_only = by_shape_only
        self.memo = {}
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        z = h + self.mlp(h)
        if rank_world()[1] > 1:
            z = _SyncGrad.apply(z, self.memo, self.by_shape_only)
        return self.head(self.norm(self.drop(z)))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def stale_grad():
    return tpdiag.Target(model=LM(True, 0.0), plan={}, vocab_size=VOCAB, inputs=_tokens)


def fresh_grad():
    return tpdiag.Target(model=LM(False, 0.0), plan={}, vocab_size=VOCAB, inputs=_tokens)


def stale_grad_drop():
    """stale_grad with dropout on the residual stream: the float64 re-execution of the model's own
    code, which makes the residual grad, is refused (a random op)."""
    return tpdiag.Target(model=LM(True, 0.1), plan={}, vocab_size=VOCAB, inputs=_tokens)


def fresh_grad_drop():
    return tpdiag.Target(model=LM(False, 0.1), plan={}, vocab_size=VOCAB, inputs=_tokens)
