"""A user's model with a sparse token embedding (`nn.Embedding(sparse=True)`: its weight grad a
sparse COO tensor), replicated on every rank, an MLP column/row-parallel:

    tpdiag compare --model py:tests/models/sparse_embed.py:target --tp 1,2
"""
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

VOCAB, DIM, HIDDEN = 32, 16, 32


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=True)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def target():
    return tpdiag.Target(model=LM(), plan={"up": ColwiseParallel(), "down": RowwiseParallel()}, vocab_size=VOCAB)
