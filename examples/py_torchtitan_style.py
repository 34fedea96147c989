"""A torchtitan-shaped model for `--model py:examples/py_torchtitan_style.py:target`.

Written the way torchtitan writes its models: `forward(self, tokens)` (not `input_ids`), module
names `tok_embeddings` / `layers.N` / `norm` / `output`, and a TP plan whose LM head is a plain
`ColwiseParallel()` - torch's default `use_local_output=True`, so at TP > 1 each rank's head
returns its own slice of the vocab as a plain tensor. tpdiag passes the tokens to forward's
first parameter whatever its name, and re-marks the local vocab shards (from the plan's style for
`output`) for its own logprobs, loss and records.

    tpdiag compare --model py:examples/py_torchtitan_style.py:target --tp 1,2
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN, LAYERS = 256, 128, 256, 2


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):  # torchtitan's name for the token ids
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def plan() -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": ColwiseParallel(),  # local vocab shards, unmarked
    }


def target():
    return tpdiag.Target(model=Transformer(), plan=plan(), vocab_size=VOCAB)
