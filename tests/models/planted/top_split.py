"""Megatron's split row-parallel layer at the model's top level (helper hbug15): the model's own
forward calls the column layer, the row layer (`reduce_results=False`: it returns this rank's PARTIAL
sum and its bias unadded) and a `ReduceFromTP` module, all direct children of the model - names
without a `.`. The same layers as mega_split.py. Vocab 32, hidden 32.

  top_ok         the partials reduced by ReduceFromTP, the bias added after it.   rounding
  top_noreduce   the reduce forgotten: each rank goes on with its own partial.    BUG

    tpdiag compare --model py:tests/models/planted/top_split.py:top_ok --tp 1,2 --capture hash
tests/test_top_split.py
"""
import os
import sys

import torch.nn.functional as F
from torch import nn

import tpdiag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mega_split import DIM, HIDDEN, VOCAB, ColumnParallelLinear, ReduceFromTP, RowParallelLinear, _tokens  # noqa: E402


class TopLM(nn.Module):
    def __init__(self, reduce=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = ColumnParallelLinear(DIM, HIDDEN)
        self.down = RowParallelLinear(HIDDEN, DIM)
        self.reduce = ReduceFromTP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.reduces = reduce

    def forward(self, tokens):
        x = self.embed(tokens)
        partial, bias = self.down(F.gelu(self.up(x)))
        h = x + (self.reduce(partial) if self.reduces else partial) + bias
        return self.head(self.norm(h))


def top_ok():
    return tpdiag.Target(model=TopLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def top_noreduce():
    return tpdiag.Target(model=TopLM(reduce=False), plan={}, vocab_size=VOCAB, inputs=_tokens)
