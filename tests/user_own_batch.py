"""A user's own py: target whose Target.inputs draw the batch it trains on - 2 sequences of 16
tokens - over a 50k vocabulary, as a user writes one (tests/test_preflight_py_inputs.py).

    tpdiag compare --model py:tests/user_own_batch.py:target --tp 1,2
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

VOCAB, DIM = 50_000, 16
BATCH, SEQ = 2, 16


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def inputs(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids}


def target():
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(),
            "down": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return tpdiag.Target(model=Tiny(), plan=plan, vocab_size=VOCAB, inputs=inputs)


def target_random():
    """The same model with tpdiag's random tokens: --batch-size x --seq-len is its batch."""
    t = target()
    t.inputs = None
    return t
