"""One model holding many hand-rolled TP layers side by side: every branch reads the same
embedding output (bitwise equal at every degree), so each is judged on its own in one world.

`bugs()`: every layer of layers.py with its planted mistake; `good()`: every layer correct.
Run forward-only (the hand-written in-place collectives have no autograd).
"""
import os
import sys

import torch
from torch import nn

import tpdiag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # layers.py beside this file
from layers import (HeadAttention, MeanFeatures, RowLinear, SeqParallel, ShardNorm,  # noqa: E402
                    ShardSoftmax)

VOCAB, DIM, BATCH, SEQ = 64, 32, 2, 8

# branch name -> (module, whether its bug is planted); the test reads BRANCHES for the names
BRANCHES = ("norm", "softmax", "bias", "twice", "noreduce", "mean", "gqa", "rope", "seqpar")


def branches(bug: bool) -> nn.ModuleDict:
    return nn.ModuleDict({
        "norm": ShardNorm(DIM, bug),
        "softmax": ShardSoftmax(DIM, bug),
        "bias": RowLinear(DIM, DIM, "bias-every-rank" if bug else "ok"),
        "twice": RowLinear(DIM, DIM, "twice" if bug else "ok"),
        "noreduce": RowLinear(DIM, DIM, "forgotten" if bug else "ok"),
        "mean": MeanFeatures(DIM, bug),
        "gqa": HeadAttention(DIM, heads=8, kv_heads=4, bug="gqa" if bug else None),
        "rope": HeadAttention(DIM, heads=8, kv_heads=8, bug="rope" if bug else None),
        "seqpar": SeqParallel(DIM, bug),
    })


class Parallel(nn.Module):
    def __init__(self, bug: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.branch = branches(bug)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + sum(b(h) for b in self.branch.values()) / len(self.branch))


def _target(bug):
    return tpdiag.Target(model=Parallel(bug), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def bugs():
    return _target(True)


def good():
    return _target(False)
