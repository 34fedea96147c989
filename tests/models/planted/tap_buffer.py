"""A module that returns its own buffer, read by the model's plain code (helper hreview15): a fixed
per-channel scale, kept in a float buffer (no parameter: nothing trains it, nothing asks its grad),
that the module returns as it is - `h = h * scale(h)` in the model's forward. Behind a hand-written
TP MLP block whose row-parallel all-reduce is the first divergence (rounding). Correct at every
degree. Vocab 32, dim 32, ff 64.

  table_scale   the module above

    tpdiag compare --model py:tests/models/planted/tap_buffer.py:table_scale --tp 1,2 --steps 2
"""
import os
import sys

import torch
from torch import nn

import tpdiag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the user's files beside this one
from two_paths import BATCH, DIM, SEQ, VOCAB, Block  # noqa: E402


class TableScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, DIM))

    def forward(self, h):
        return self.table


class TableLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.scale = TableScale()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        e = self.embed(tokens)
        h = e + self.block(e)
        h = h * self.scale(h)
        return self.head(self.norm(h))


def table_scale():
    return tpdiag.Target(model=TableLM(), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
