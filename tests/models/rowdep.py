"""A user's model with a kernel of its own whose reduction order depends on how many rows share
the call: `RowRMS` picks a split reduction over the features when a call has few rows (as a GPU
kernel picks split-K for a small M, to fill the machine). Each row's result is a correct RMS
norm, rounded differently by micro-batch size - rounding, not a bug."""
import torch
from torch import nn

import tpdiag

VOCAB, DIM = 128, 64


class RowRMS(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        splits = 1 if rows.shape[0] >= 16 else 4  # few rows: a split reduction
        sq = (rows * rows).reshape(rows.shape[0], splits, -1).sum(-1).sum(-1, keepdim=True)
        return (rows * torch.rsqrt(sq / rows.shape[-1] + 1e-6) * self.weight).reshape(x.shape)


class RowDepLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm = RowRMS(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.proj(self.embed(tokens))))


def target():
    model = RowDepLM()
    return tpdiag.Target(model=model, plan={}, vocab_size=VOCAB)
