"""A wrong op whose effect on its module's output is within that output's rounding (helper hbug14):
a user's block adds a small centring term, `h - LAMBDA * c`, whose statistic c is "summed over the
ranks' shards" - scaled by the world size although every rank holds the whole row. Every weight is
replicated (no plan), so at TP=1 the model is the same function and at TP=2 only that op differs:
c is 2x, and with LAMBDA = 1e-7 the block's output moves by a few ULP, within what rounding allows
its output. The op-level second pass re-executes c's multiply in float64 and finds it far (a wrong
result); the module record alone reads rounding. Vocab 32, dim 16, batch 2, seq 8.

  centre_world  c = rowsum(h) * world_size                                          BUG (at the op)
  centre_ok     c = rowsum(h)                                                       bitwise

    tpdiag compare --model py:tests/models/planted/tiny_term.py:centre_world --tp 1,2
tests/test_op_bug_gate.py
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 16, 2, 8
LAMBDA = 1e-7


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class Centred(nn.Module):
    def __init__(self, scale_by_world: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.scale_by_world = scale_by_world

    def forward(self, x):
        h = x @ self.w.t()
        # "the row sum over the ranks' shards": but every rank holds the whole row
        c = h.sum(-1, keepdim=True) * (world_size() if self.scale_by_world else 1)
        return h - LAMBDA * c


class TinyLM(nn.Module):
    def __init__(self, scale_by_world=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Centred(scale_by_world)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def centre_world():
    return tpdiag.Target(model=TinyLM(scale_by_world=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def centre_ok():
    return tpdiag.Target(model=TinyLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)
