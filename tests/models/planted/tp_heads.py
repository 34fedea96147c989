"""Attention split by heads with a DTensor plan (q/k/v `ColwiseParallel()`, o `RowwiseParallel()`,
torch's default local outputs), its heads reshaped in the user's forward (helper hbug7). Vocab
32, hidden 32, 4 heads of 8: seconds per world on the CPU.

  heads_view  the projections viewed as `(B, S, n_heads, -1)`: the GLOBAL head count with the head
              dim inferred. At TP=1 that is 4 heads of 8; at TP=2 the rank's 16 columns become 4
              "heads" of 4 - each real head cut in two, attended over half its dims, with the
              scale of a head of 8. It runs without an error (HF's attention once read this
              way; it now views `(*shape, -1, head_dim)`).
  heads_ok    the twin: `(B, S, -1, head_dim)`, the rank's own 2 heads of 8.

    tpdiag compare --model py:tests/models/planted/tp_heads.py:heads_view --tp 1,2
tests/test_tp_gathers.py; docs/planted.md has the verdicts.
"""
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, H, B, S = 32, 32, 4, 2, 8
HD = D // H


class Attn(nn.Module):
    def __init__(self, global_heads):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.global_heads = global_heads

    def _heads(self, t, b, s):
        # the mistake (global_heads): the model's head count, the head dim whatever is left
        shape = (b, s, H, -1) if self.global_heads else (b, s, -1, HD)
        return t.view(shape).transpose(1, 2)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (self._heads(w(x), b, s) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HD ** -0.5)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class LM(nn.Module):
    def __init__(self, global_heads):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.attn = Attn(global_heads)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.attn(h)))


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel()}


def _target(global_heads):
    import torch

    return tpdiag.Target(model=LM(global_heads), plan=_plan(), vocab_size=V,
                         inputs=lambda g: torch.randint(0, V, (B, S), generator=g))


def heads_view():
    return _target(True)


def heads_ok():
    return _target(False)
