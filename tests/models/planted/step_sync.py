"""A user's TP mistake that only the second step's BACKWARD shows, beside its correct twin (helper
hbug9). A hand-written column/row-parallel MLP: each rank holds only its shard of `up` and `down`
(sliced from a master drawn whole) and the WHOLE per-feature `gain`, of which it uses its columns -
so each rank's gain grad covers its slice and the replicas stay equal only if the grads are summed
over the ranks. The user sums them in a tensor hook on the gain, guarded by a flag so that a
recomputed forward (activation checkpointing) cannot sync twice. Vocab 32, hidden 32, seq 8.

  sync_once   the mistake: the flag is never cleared, so only step 0's gain grad is summed; at
              step 1 each rank steps its replica with its own slice's grad - the forward, the
              loss and every activation grad are right, the replicas drift from step 1 on
  sync_every  the twin: the flag cleared at every forward

    tpdiag compare --model py:tests/models/planted/step_sync.py:sync_once --tp 1,2 --steps 2
tests/test_step_sync.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 32, 2, 8


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


class GainMLP(nn.Module):
    def __init__(self, clear_flag):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.clear_flag, self.synced = clear_flag, False
        if rank_world()[1] > 1:
            self.gain.register_hook(self._sync)

    def _sync(self, g):
        if self.synced:  # a recomputed forward's backward: already summed
            return g
        self.synced = True
        g = g.clone()
        dist.all_reduce(g)
        return g

    def forward(self, x):
        r, n = rank_world()
        if self.clear_flag:
            self.synced = False
        m = HIDDEN // n
        h = F.gelu(((_Copy.apply(x) if n > 1 else x) @ self.up.t()) * self.gain[r * m:(r + 1) * m])
        y = h @ self.down.t()
        return x + (_Reduce.apply(y) if n > 1 else y)


class LM(nn.Module):
    def __init__(self, clear_flag):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = GainMLP(clear_flag)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _target(clear_flag):
    return tpdiag.Target(model=LM(clear_flag), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def sync_once():
    return _target(False)


def sync_every():
    return _target(True)
