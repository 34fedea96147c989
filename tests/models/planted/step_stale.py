"""A user's TP mistake that only the second step shows, beside its correct twin. Every rank holds only
its SHARD of the MLP's weights (plain tensors sliced from a master drawn whole); the all-reduce is
written with torch.distributed. Vocab 32, hidden 32, seq 8.

  stale_reduce / fresh_reduce  a row-parallel projection whose all-reduced output is memoised by the
               input's shape (the user's "skip the collective on recompute" for activation
               checkpointing, keyed too loosely). The mistake: the key is the shape alone, so at
               TP > 1 the second step's forward returns the FIRST step's reduced output - at TP=1
               there is no collective and nothing is memoised. Step 0 is right; step 1's MLP output
               is step 0's. Twin: the memo keyed by the input tensor itself (its id and version),
               so a new step's input never hits it.

    tpdiag compare --model py:tests/models/planted/step_stale.py:stale_reduce --tp 1,2 --steps 2
tests/test_steps.py.
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


class MemoReduce(nn.Module):
    """The all-reduce of a row-parallel partial sum, memoised for recompute."""

    def __init__(self, by_shape_only):
        super().__init__()
        self.by_shape_only = by_shape_only
        self.memo = {}

    def forward(self, partial):
        if rank_world()[1] == 1:
            return partial
        key = tuple(partial.shape) if self.by_shape_only else (id(partial), partial._version)
        hit = self.memo.get(key)
        if hit is not None and hit[0] is not None:
            # the recomputed forward's reduced value, with the autograd of the partial it stands for
            return partial + (hit[0] - partial).detach()
        out = _Reduce.apply(partial)
        self.memo = {key: (out.detach(),)}
        return out


class MLP(nn.Module):
    def __init__(self, by_shape_only):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))
        self.reduce = MemoReduce(by_shape_only)

    def forward(self, x):
        xc = _Copy.apply(x) if rank_world()[1] > 1 else x
        return x + self.reduce(F.gelu(xc @ self.up.t()) @ self.down.t())


class LM(nn.Module):
    def __init__(self, by_shape_only):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(by_shape_only)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def stale_reduce():
    return tpdiag.Target(model=LM(True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def fresh_reduce():
    return tpdiag.Target(model=LM(False), plan={}, vocab_size=VOCAB, inputs=_tokens)
