"""A GPT-J / PaLM-style PARALLEL block written by hand, Megatron's way (helper hplant18): attention and
the MLP both read one LayerNorm of the residual, and their row-parallel partial outputs are added
BEFORE one all-reduce (the block's single collective - the reason people write it this way). Each rank
holds only its shards (q/k/v and `up` rows, `o` and `down` columns, cut from masters drawn whole);
the LayerNorm and the biases are whole on every rank. Vocab 32, dim 32, 4 heads of 8, ffn 64, seq 8.

  fused_reduce  attn_partial + mlp_partial, all-reduced once, then the two biases and the
                residual: the same sum as TP=1 in another order.                     rounding
  bias_inside   the MLP's output bias added to the partial before the all-reduce, on every
                rank: the bias counted TP times.                                      BUG
  resid_inside  the residual added to the partial before the all-reduce, on every rank (the
                "one add less" a port makes): the residual counted TP times.          BUG

    tpdiag compare --model py:tests/models/planted/parallel_block.py:bias_inside --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS, FFN, BATCH, SEQ = 32, 32, 4, 64, 2, 8
HD = DIM // HEADS


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return nn.Parameter(master.narrow(dim, r * per, per).clone())


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class ParallelBlock(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.ln = nn.LayerNorm(DIM)
        self.wq = _shard(torch.randn(DIM, DIM) / DIM ** 0.5, 0)
        self.wk = _shard(torch.randn(DIM, DIM) / DIM ** 0.5, 0)
        self.wv = _shard(torch.randn(DIM, DIM) / DIM ** 0.5, 0)
        self.wo = _shard(torch.randn(DIM, DIM) / DIM ** 0.5, 1)
        self.o_bias = nn.Parameter(torch.randn(DIM) * 0.1)
        self.up = _shard(torch.randn(FFN, DIM) / DIM ** 0.5, 0)
        self.down = _shard(torch.randn(DIM, FFN) / FFN ** 0.5, 1)
        self.down_bias = nn.Parameter(torch.randn(DIM) * 0.1)

    def forward(self, x):
        n = rank_world()[1]
        h = self.ln(x)
        h = _Copy.apply(h) if n > 1 else h
        b, s, _ = h.shape
        q, k, v = (F.linear(h, w).view(b, s, -1, HD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        partial = F.linear(a, self.wo) + F.linear(F.gelu(F.linear(h, self.up)), self.down)
        if self.how == "bias_inside":
            partial = partial + self.down_bias
        if self.how == "resid_inside":
            partial = partial + x
        y = _Reduce.apply(partial) if n > 1 else partial
        y = y + self.o_bias
        if self.how != "bias_inside":
            y = y + self.down_bias
        return y if self.how == "resid_inside" else x + y


class LM(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = ParallelBlock(how)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.block(self.embed(tokens))))


def _target(how):
    return tpdiag.Target(model=LM(how), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def fused_reduce():
    return _target("fused_reduce")


def bias_inside():
    return _target("bias_inside")


def resid_inside():
    return _target("resid_inside")
