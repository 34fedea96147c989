"""More of a user's hand-written TP mistakes, each beside its correct twin (helper hbug8). Every rank
holds only its SHARD of a sharded weight (plain tensors sliced from a master drawn whole); every
collective is written with torch.distributed. Vocab 32, hidden 32, seq 8.

  embed_clamp / embed_ok  a vocab-parallel embedding (Megatron's VocabParallelEmbedding). The
               mistake: the last rank clamps the ids outside its range into it instead of masking
               their rows to zero, so it adds one of its own rows for every other rank's token.
               Twin: every rank masks.
  rope_bf16 / rope_ok  a float32 model whose rotary cos/sin table is built in bfloat16 at TP > 1 only
               (the user's TP wrapper casts the model's buffers to bf16 for the collectives and the
               table is rebuilt from them): every q/k rotation at TP=2 is off by bf16 rounding.
               Twin: the table in float32 at every degree.
  scale_tp / scale_ok  a static loss scale: the loss multiplied by S, each grad divided by S in a
               hook. The mistake: the hooks of the replicated parameters divide by S * TP (a
               data-parallel average copied into a TP-only job). Twin: S everywhere.

    tpdiag compare --model py:tests/models/planted/tp_misc.py:embed_clamp --tp 1,2
tests/test_tp_misc.py; docs/planted.md has every case's verdict.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ, HEADS = 32, 32, 64, 2, 8, 4
SCALE = 1024.0


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


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


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


class VocabEmbedding(nn.Module):
    """VocabParallelEmbedding: this rank's rows of the table; ids outside its range masked."""

    def __init__(self, clamp_last):
        super().__init__()
        self.weight = nn.Parameter(_shard(torch.randn(VOCAB, DIM), 0))
        self.clamp_last = clamp_last

    def forward(self, ids):
        r, n = rank_world()
        if n == 1:
            return F.embedding(ids, self.weight)
        per = self.weight.shape[0]
        outside = (ids < r * per) | (ids >= (r + 1) * per)
        local = (ids - r * per).clamp(0, per - 1)
        out = F.embedding(local, self.weight)
        if not (self.clamp_last and r == n - 1):
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce(out)


class MLP(nn.Module):
    """Megatron's column then row parallel MLP."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.down = nn.Parameter(_shard(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5, 1))

    def forward(self, x):
        return x + reduce(F.gelu(copy(x) @ self.up.t()) @ self.down.t())


class EmbedLM(nn.Module):
    def __init__(self, clamp_last):
        super().__init__()
        self.embed = VocabEmbedding(clamp_last)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def embed_clamp():
    return tpdiag.Target(model=EmbedLM(True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def embed_ok():
    return tpdiag.Target(model=EmbedLM(False), plan={}, vocab_size=VOCAB, inputs=_tokens)


class Rotary(nn.Module):
    def __init__(self, head_dim, bf16_at_tp):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(SEQ).float(), inv)
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos(), emb.sin()
        if bf16_at_tp and rank_world()[1] > 1:
            cos, sin = cos.bfloat16().float(), sin.bfloat16().float()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        x1, x2 = x.chunk(2, -1)
        return x * self.cos + torch.cat([-x2, x1], -1) * self.sin


class Attention(nn.Module):
    """Megatron's attention split by heads: q/k/v column shards (whole heads), out row shard."""

    def __init__(self, bf16_at_tp):
        super().__init__()
        self.hd = DIM // HEADS
        qkv = [torch.randn(DIM, DIM) / DIM ** 0.5 for _ in range(3)]
        self.wq, self.wk, self.wv = (nn.Parameter(_shard(w, 0)) for w in qkv)
        self.wo = nn.Parameter(_shard(torch.randn(DIM, DIM) / DIM ** 0.5, 1))
        self.rope = Rotary(self.hd, bf16_at_tp)

    def forward(self, x):
        B, S, _ = x.shape
        xc = copy(x)
        q, k, v = ((xc @ w.t()).view(B, S, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + reduce(o.transpose(1, 2).reshape(B, S, -1) @ self.wo.t())


class RopeLM(nn.Module):
    def __init__(self, bf16_at_tp):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attention(bf16_at_tp)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.attn(self.embed(tokens))))


def rope_bf16():
    return tpdiag.Target(model=RopeLM(True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def rope_ok():
    return tpdiag.Target(model=RopeLM(False), plan={}, vocab_size=VOCAB, inputs=_tokens)


class ScaledLM(nn.Module):
    def __init__(self, tp_in_replicas):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        n = rank_world()[1]
        sharded = {id(self.mlp.up), id(self.mlp.down)}
        for p in self.parameters():
            div = SCALE * (n if tp_in_replicas and id(p) not in sharded else 1)
            p.register_hook(lambda g, div=div: g / div)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _scaled_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100) * SCALE


def scale_tp():
    return tpdiag.Target(model=ScaledLM(True), plan={}, vocab_size=VOCAB, inputs=_tokens, loss=_scaled_loss)


def scale_ok():
    return tpdiag.Target(model=ScaledLM(False), plan={}, vocab_size=VOCAB, inputs=_tokens, loss=_scaled_loss)
