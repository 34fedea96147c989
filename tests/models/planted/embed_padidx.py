"""A Megatron-style vocab-parallel embedding written by hand with a padding token (helper hred14):
rank r keeps rows [r V/N, (r+1) V/N) of one master drawn whole as its own `nn.Embedding`, masks
the ids outside its range to zero rows and all-reduces (Megatron's VocabParallelEmbedding). The
single-GPU model had `nn.Embedding(VOCAB, DIM, padding_idx=PAD)` (PAD = 0: the pad row gets no
grad); the user carried `padding_idx=PAD` into the shard's constructor. Vocab 32, hidden 32,
seq 8; every batch holds id 16 (the first id of rank 1's range at TP=2) and the pad id.

  pad_every_shard  `nn.Embedding(V // N, DIM, padding_idx=PAD)` on every rank: at TP=2 local row 0
                   of rank 1 is global id 16, whose grad is now dropped as if it were padding - the
                   forward is exact, one row of the embedding's grad is zero, the step leaves it.
  pad_owner_only   the twin: the padding index given (as a LOCAL index) to the rank whose range
                   holds PAD only.

    tpdiag compare --model py:tests/models/planted/embed_padidx.py:pad_every_shard --tp 1,2
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ, PAD = 32, 32, 2, 8, 0


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """Megatron's g: the ranks' rows summed; the output is replicated, its grad passes as is."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class VocabParallelEmbedding(nn.Module):
    def __init__(self, owner_only):
        super().__init__()
        r, n = rank_world()
        per = VOCAB // n
        self.start, self.end = r * per, (r + 1) * per
        master = torch.randn(VOCAB, DIM)
        if owner_only:
            pad = PAD - self.start if self.start <= PAD < self.end else None
        else:
            pad = PAD  # the mistake: a global id used as this shard's local index
        # _weight: the rows are the master's (no per-rank draw, the pad row kept as drawn)
        self.shard = nn.Embedding(per, DIM, padding_idx=pad, _weight=master[self.start:self.end].clone())

    def forward(self, ids):
        if rank_world()[1] == 1:
            return self.shard(ids)
        outside = (ids < self.start) | (ids >= self.end)
        rows = self.shard((ids - self.start).masked_fill(outside, 0))
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return _Reduce.apply(rows)


class LM(nn.Module):
    def __init__(self, owner_only):
        super().__init__()
        self.embed = VocabParallelEmbedding(owner_only)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.mlp(h))


def _inputs(g):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tokens[0, 0], tokens[1, 0], tokens[1, -1] = VOCAB // 2, PAD, PAD  # a pad id at the end
    return tokens


def _target(owner_only):
    return tpdiag.Target(model=LM(owner_only), plan={}, vocab_size=VOCAB, inputs=_inputs)


def pad_every_shard():
    return _target(False)


def pad_owner_only():
    return _target(True)
