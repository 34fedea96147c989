"""A user's context-parallel block whose projection flattens its positions seq-major (helper
hreview15): each rank keeps its slice of the positions from the embedding on ([B, S/N, D], the
batch first), and its projection runs as Megatron's sequence-first code does - `x.transpose(0, 1)
.reshape(S/N * B, D) @ W.T` - so the GEMM's rows are position-major (p0 b0, p0 b1, p1 b0, ...).
Stacked along dim 0 the ranks' row blocks are TP=1's rows in order; put back batch-major (as a
batch-first activation's flattening would be) they are not. The model is correct at every degree.

  seq_major   the projection above, the positions gathered again before the replicated head.

    tpdiag compare --model py:tests/models/planted/seq_major.py:seq_major --tp 1,2
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mine(t):
    r, n = rank_world()
    s = t.shape[1] // n
    return t[:, r * s:(r + 1) * s].contiguous()


def _gathered(t):
    parts = [torch.empty_like(t) for _ in range(rank_world()[1])]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 1)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _mine(x)

    @staticmethod
    def backward(ctx, g):
        return _gathered(g)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gathered(x)

    @staticmethod
    def backward(ctx, g):
        return _mine(g)


class _AllSum(torch.autograd.Function):
    """Every rank's partial sum added; each rank's grad of the sum is the whole one."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def _cp(fn, x):
    return fn.apply(x) if rank_world()[1] > 1 else x


def _summed(g):
    if rank_world()[1] > 1:
        g = g.clone()
        dist.all_reduce(g)
    return g


class SeqFirstProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.weight.register_hook(_summed)  # each rank's grad covers its own positions

    def forward(self, x):
        b, s, d = x.shape
        rows = x.transpose(0, 1).reshape(s * b, d)  # position-major, as sequence-first code keeps them
        y = (rows @ self.weight.t()).view(s, b, d).transpose(0, 1)
        # centred over every position: each rank's sum of its own, all-reduced (rounding only)
        total = _cp(_AllSum, y.sum(1, keepdim=True))
        return y - total / (s * rank_world()[1])


class SeqMajorLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = SeqFirstProj()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = _cp(_Split, self.embed(tokens))
        x = self.proj(x)
        return self.head(_cp(_Gather, x))


def seq_major():
    return tpdiag.Target(model=SeqMajorLM(), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
