"""A new user's first model: 4 attention heads of 16 (hidden 64), q/k/v `ColwiseParallel()`, o
`RowwiseParallel()`, asked for `--tp 1,16` (helper hinput16). 16 divides every dimension the plan
splits (64 columns), not the heads: each rank would hold a quarter of a head, and every TP=16
world failed in the user's `view(b, s, -1, head_dim)` ("shape '[2, 16, -1, 16]' is invalid for
input of size 128") after the TP=1 world and its rerun had run. Refused now before any world.

  counted     torchtitan-style: the attention keeps `n_heads` (and `n_kv_heads`: 2 kv heads)
  head_dim    transformers-style: only `head_dim` on the module, the heads are columns / head_dim
  mlp_only    a plan that splits the MLP alone (ffn 128): the heads stay whole, so TP=8 is fine

    tpdiag compare --model py:tests/models/planted/four_heads.py:counted --tp 1,16

At `--tp 1,2 --forward-only` it runs: rounding only, `row-parallel-reduction` at attention.wo (CPU).
tests/test_input_heads.py.
"""
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, H, KV, FFN = 64, 64, 4, 2, 128
HD = D // H


class Attention(nn.Module):
    def __init__(self, counted: bool):
        super().__init__()
        if counted:
            self.n_heads, self.n_kv_heads = H, KV
        self.head_dim = HD
        self.wq = nn.Linear(D, H * HD, bias=False)
        self.wk = nn.Linear(D, KV * HD, bias=False)
        self.wv = nn.Linear(D, KV * HD, bias=False)
        self.wo = nn.Linear(H * HD, D, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, FFN, bias=False)
        self.down = nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class LM(nn.Module):
    def __init__(self, counted: bool):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.attention = Attention(counted)
        self.mlp = MLP()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.attention(h)
        return self.head(h + self.mlp(h))


def _plan(attention: bool):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    if attention:
        plan.update({"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                     "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()})
    return plan


def counted():
    return tpdiag.Target(model=LM(True), plan=_plan(True), vocab_size=V)


def head_dim():
    return tpdiag.Target(model=LM(False), plan=_plan(True), vocab_size=V)


def mlp_only():
    return tpdiag.Target(model=LM(True), plan=_plan(False), vocab_size=V)
