"""A user module that writes Python state outside its tensors (helper hhook16): the row-parallel down
projection of a DTensor-planned MLP LM ramps its output in over the first calls, counting its calls
in a module-level global (`global CALLS; CALLS += 1`) - a warm-up scale as a user writes one.
Correct at every degree: its row-parallel all-reduce is the first divergence, rounding.

  global_count   the counter a module-level global
  dict_count     the same counter kept in a dict the module holds (`self.seen["calls"] += 1`)

    tpdiag compare --model py:tests/models/planted/global_state.py:global_count --tp 1,2 --steps 2
"""
import torch
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, WARMUP = 64, 32, 64, 4
CALLS = 0


class WarmGlobal(nn.Linear):
    def forward(self, x):
        global CALLS
        CALLS += 1
        return super().forward(x) * min(1.0, CALLS / WARMUP)


class WarmDict(nn.Linear):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = {"calls": 0}

    def forward(self, x):
        self.seen["calls"] += 1
        return super().forward(x) * min(1.0, self.seen["calls"] / WARMUP)


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


def global_count():
    return tpdiag.Target(model=MLPLM(WarmGlobal), plan=_plan(), vocab_size=VOCAB)


def dict_count():
    return tpdiag.Target(model=MLPLM(WarmDict), plan=_plan(), vocab_size=VOCAB)
