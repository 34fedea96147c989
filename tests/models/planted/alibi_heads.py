"""A user's ALiBi language model. q/k/v column-parallel (local tensors), o row-parallel.
bug(): the ALiBi slopes are computed from the LOCAL head count (q.shape[2]) - at TP=2 rank r's
head j gets the slope of global head j of a 2x smaller model. twin(): slopes of the global
heads, indexed by this rank's head offset."""
import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import tpdiag

V, D, H, L = 128, 64, 4, 2
B, S = 2, 12


def slopes(n):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / n) for i in range(n)])


class Attn(nn.Module):
    def __init__(self, global_slopes):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D, bias=False)
        self.global_slopes = global_slopes

    def forward(self, x):
        b, s, _ = x.shape
        hd = D // H
        q = self.q(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.k(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.v(x).view(b, s, -1, hd).transpose(1, 2)
        nh = q.shape[1]
        if self.global_slopes:
            r = dist.get_rank() if dist.is_initialized() else 0
            m = slopes(H)[r * nh:(r + 1) * nh]
        else:
            m = slopes(nh)
        pos = torch.arange(s)
        bias = -(pos[None, :] - pos[:, None]).clamp(max=0).abs().float()  # -(i-j) for j<=i
        bias = m[:, None, None] * bias[None] 
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        bias = bias.masked_fill(~mask, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attn(g)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class LM(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(g) for _ in range(L))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
            "blocks.*.attn.v": ColwiseParallel(), "blocks.*.attn.o": RowwiseParallel(),
            "blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def inputs(g):
    ids = torch.randint(0, V, (B, S), generator=g)
    return {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)}


def bug():
    return tpdiag.Target(model=LM(False), plan=plan(), inputs=inputs, vocab_size=V)


def twin():
    return tpdiag.Target(model=LM(True), plan=plan(), inputs=inputs, vocab_size=V)
