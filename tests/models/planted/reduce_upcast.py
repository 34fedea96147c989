"""A hand-written row-parallel MLP whose all-reduce "runs in float32 for accuracy" (helper hbug12):
rank r holds `up` rows and `down` columns [r FF/n, (r+1) FF/n) of one full draw. Vocab 32,
hidden 32, ffn 64.

  reduce_upcast     `dist.all_reduce(t.float())`: in float32 `.float()` is `t` itself and the sum
                    lands in `t`; in bfloat16 it is a new tensor, the sum lands there and is
                    dropped - each rank goes on with its own partial sum. Right in float32, wrong
                    only with `--dtype bfloat16`.
  reduce_upcast_ok  the twin: the float32 buffer reduced and cast back.

    tpdiag compare --model py:tests/models/planted/reduce_upcast.py:reduce_upcast --tp 1,2 --dtype bfloat16
tests/test_reduce_upcast.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _ReduceFP32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, keep):
        if keep:
            buf = t.float()
            dist.all_reduce(buf)
            return buf.to(t.dtype)
        t = t.clone()
        # the mistake (not keep): the sum goes to `.float()`'s result, a copy unless t is float32
        dist.all_reduce(t.float())
        return t

    @staticmethod
    def backward(ctx, g):
        return g, None


class MLP(nn.Module):
    def __init__(self, keep):
        super().__init__()
        r, n = rank_world()
        k = FF // n
        up, down = torch.randn(FF, DIM) / DIM ** 0.5, torch.randn(DIM, FF) / FF ** 0.5
        self.up = nn.Parameter(up[r * k:(r + 1) * k].clone())
        self.down = nn.Parameter(down[:, r * k:(r + 1) * k].clone())
        self.keep = keep

    def forward(self, x):
        n = rank_world()[1]
        h = F.linear(F.gelu(F.linear(_Copy.apply(x) if n > 1 else x, self.up)), self.down)
        return x + (_ReduceFP32.apply(h, self.keep) if n > 1 else h)


class LM(nn.Module):
    def __init__(self, keep):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(keep)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _target(keep):
    return tpdiag.Target(model=LM(keep), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def reduce_upcast():
    return _target(False)


def reduce_upcast_ok():
    return _target(True)
