"""A user's MoE LM with an expert capacity (GShard / Switch style): each expert takes at most
C = ceil(capacity x tokens in the call / experts) tokens, the overflow is dropped. C depends on the
tokens per call, so a row's output depends on the other rows of its micro-batch: logprobs move
with the micro-batch size by far more than rounding. `capacity=None` routes every token (no drop):
the same model whose micro-batch difference, if any, is rounding.

    tpdiag compare --model py:tests/models/planted/moe_capacity.py:dropping --tp 1 --micro-batch 4,1
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, EXPERTS, FFN = 128, 64, 4, 128


class CapacityMoE(nn.Module):
    def __init__(self, capacity):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) * 0.05)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * 0.05)
        self.capacity = capacity

    def forward(self, x):
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = self.router(tokens).softmax(-1)
        expert = probs.argmax(-1)
        limit = tokens.shape[0] if self.capacity is None else max(
            1, math.ceil(self.capacity * tokens.shape[0] / EXPERTS))
        out = torch.zeros_like(tokens)
        for e in range(EXPERTS):
            idx = (expert == e).nonzero().flatten()[:limit]
            h = F.gelu(tokens[idx] @ self.w_in[e]) @ self.w_out[e]
            out[idx] = h * probs[idx, e:e + 1]
        return out.reshape(b, s, d)


class Block(nn.Module):
    def __init__(self, capacity):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = CapacityMoE(capacity)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class LM(nn.Module):
    def __init__(self, capacity):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(capacity) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def dropping():
    torch.manual_seed(0)
    return tpdiag.Target(model=LM(capacity=1.0), plan={}, vocab_size=VOCAB)


def routed():
    torch.manual_seed(0)
    return tpdiag.Target(model=LM(capacity=None), plan={}, vocab_size=VOCAB)


def dropping_close():
    """`dropping` with a router 1000x smaller: its top-1 choices are near ties (not clear to
    probes/float64_mode._clear_choice), so only the recorded, equal choices rule out a flip."""
    t = dropping()
    with torch.no_grad():
        for b in t.model.blocks:
            b.moe.router.weight.mul_(1e-3)
    return t
