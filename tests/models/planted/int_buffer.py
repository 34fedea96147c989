"""An integer buffer read by a later step's forward (helper hanchor21): the row-parallel down
projection of a DTensor-planned MLP LM ramps its output in over the first tokens it has seen, the
count kept in a long buffer (`self.register_buffer("seen", torch.zeros((), dtype=torch.long))`) - a
warm-up scale as a user writes one. Step 0 reads 0 at every degree; the count written during step 0 is
what step 1's forward reads.

  seen_tokens   counts the tokens of its input (batch x positions): the same at every degree - correct
  seen_width    counts the tokens as the elements it holds over its width: `down`'s input is the rank's
                column shard at TP > 1, so each rank counts half of what TP=1 counts, and step 1 ramps
                in at about half the scale - a bug that acts from the second step on

    tpdiag compare --model py:tests/models/planted/int_buffer.py:seen_width --tp 1,2 --steps 2
"""
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import tpdiag

VOCAB, DIM, HIDDEN, WARMUP = 64, 32, 64, 128


class WarmTokens(nn.Linear):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def count(self, x):
        return x.shape[0] * x.shape[1]

    def forward(self, x):
        scale = min(1.0, (int(self.seen) + 1) / WARMUP)
        self.seen += self.count(x)
        return super().forward(x) * scale


class WarmWidth(WarmTokens):
    def count(self, x):
        # the tokens from the elements this rank holds: at TP > 1 its column shard, half of them
        local = x.to_local() if isinstance(x, DTensor) else x
        return local.numel() // self.in_features


class MLPLM(nn.Module):
    def __init__(self, down):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = down(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.down(torch.nn.functional.silu(self.up(h)))
        return self.head(h)


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def seen_tokens():
    return tpdiag.Target(model=MLPLM(WarmTokens), plan=_plan(), vocab_size=VOCAB)


def seen_width():
    return tpdiag.Target(model=MLPLM(WarmWidth), plan=_plan(), vocab_size=VOCAB)
