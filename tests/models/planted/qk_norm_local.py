"""OLMo2-style QK-norm written the way a first TP port writes it (helper hnew14): the whole q/k
projection normalised before it is split into heads, `F.rms_norm(xq, xq.shape[-1:])` - which at
TP > 1, after a column-parallel wq that returns each rank's local columns, normalises over the
local columns only. A wrong result at TP=2 inside the attention's own forward; `qk_ok` normalises
each head (the head_dim is whole on every rank): rounding only at `--tp 1,2 --forward-only`, its
first divergence `attention.wo`'s row-parallel-reduction."""
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS = 64, 32, 4


class Attention(nn.Module):
    def __init__(self, per_head: bool):
        super().__init__()
        self.per_head, self.head_dim = per_head, DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        if not self.per_head:
            xq = F.rms_norm(xq, xq.shape[-1:])  # over the local columns at TP > 1: the bug
            xk = F.rms_norm(xk, xk.shape[-1:])
        xq, xk, xv = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (xq, xk, xv))
        if self.per_head:
            xq, xk = F.rms_norm(xq, xq.shape[-1:]), F.rms_norm(xk, xk.shape[-1:])
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class LM(nn.Module):
    def __init__(self, per_head: bool):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.attention = Attention(per_head)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        return self.output(h + self.attention(h))


def plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()}


def qk_local():
    return tpdiag.Target(model=LM(per_head=False), plan=plan(), vocab_size=VOCAB)


def qk_ok():
    return tpdiag.Target(model=LM(per_head=True), plan=plan(), vocab_size=VOCAB)
