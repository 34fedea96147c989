"""A hand-written Megatron-style TP MLP LM whose user syncs the grads of the REPLICATED parameters
over the TP group "so the replicas cannot drift" (helper hplant18): a post-accumulate-grad hook on
every parameter that is not a shard all-reduces its grad. Each rank holds only its shards of `up`
(rows) and `down` (columns), cut from masters drawn whole; the embedding, the norms and the head are
whole on every rank, and their grads are already the whole grads there (Megatron's f/g put the
ranks' shares together in the activations' grads). Vocab 32, dim 32, ffn 64, seq 8.

  sync_sum   all-reduce SUM: every replicated grad becomes TP x its value. Adam's update of a
             grad scaled by a constant is the same up to its eps, so the parameters barely move
             apart - the grads are wrong.                                                BUG
  sync_avg   all-reduce SUM, divided by TP: the ranks' grads are equal, so the mean is each
             one's value.                                                           rounding / bitwise

    tpdiag compare --model py:tests/models/planted/grad_sync_all.py:sync_sum --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    p = nn.Parameter(master.narrow(dim, r * per, per).clone())
    p.tensor_model_parallel = True
    return p


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


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = _shard(torch.randn(FFN, DIM) / DIM ** 0.5, 0)
        self.down = _shard(torch.randn(DIM, FFN) / FFN ** 0.5, 1)

    def forward(self, x):
        n = rank_world()[1]
        y = F.linear(F.gelu(F.linear(_Copy.apply(x) if n > 1 else x, self.up)), self.down)
        return _Reduce.apply(y) if n > 1 else y


class LM(nn.Module):
    def __init__(self, average):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        for p in self.parameters():
            if not getattr(p, "tensor_model_parallel", False):
                p.register_post_accumulate_grad_hook(lambda p: self._sync(p, average))

    @staticmethod
    def _sync(p, average):
        n = rank_world()[1]
        if n > 1:
            dist.all_reduce(p.grad)
            if average:
                p.grad.div_(n)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.mlp(self.ln(x))
        return self.head(self.norm(x))


def _target(average):
    return tpdiag.Target(model=LM(average), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def sync_sum():
    return _target(False)


def sync_avg():
    return _target(True)
