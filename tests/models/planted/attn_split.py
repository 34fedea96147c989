"""Attention split over the TP ranks by heads, with the two layout mistakes people make when the
heads are not one plain Linear per q/k/v (helper hbug6). Vocab 32, hidden 32, 4 heads of 8,
seq 8: seconds per world on the CPU.

  qkv_wholesale / qkv_per_head  one fused QKV Linear, sharded by a torchtitan-style plan
                 (`ColwiseParallel()` on it, `RowwiseParallel()` on the out projection). The
                 mistake: the fused weight is laid out [q | k | v] (all q rows, then all k, then
                 all v) and the forward cuts the rank's local output in three - the plan gives
                 rank r a contiguous block of rows, so at TP=2 rank 0's "k" is the second half of
                 the q heads and its "v" the first half of the k heads: the TP=2 model computes
                 another function, with no error. Twin: Megatron's layout, the rows grouped per
                 head [q_h | k_h | v_h], so a contiguous block is whole heads with their own k, v.
  gqa_rep_grad / gqa_rep_ok  grouped-query attention with fewer kv heads than TP ranks (4 query
                 heads, 1 kv head), written by hand: q column-parallel by heads, the kv head
                 REPLICATED on every rank (Megatron / vLLM replicate kv heads when kv_heads < TP),
                 out projection row-parallel. Each rank's kv weight grad covers only its own
                 query heads, so the replicas' grads must be summed over the ranks. The mistake:
                 they are not (the forward is exact; the replicas drift at the step). Twin: summed.
  gqa_round_robin / gqa_blocked  4 query heads, 2 kv heads, written by hand for any TP: up to TP=2
                 each rank holds whole kv heads; at TP=4 (kv_heads < TP) each rank holds one kv head,
                 replicated on the two ranks whose query heads read it. The mistake: that kv head
                 taken round-robin (`r % kv_heads`) where query head g reads kv head g // 2 (rank r
                 needs `r * kv_heads // TP`): right at TP=2, wrong at TP=4 (ranks 1 and 2 swap).
                 Run at `--tp 1,2,4`. Twin: blocked.
  attn_ok        both twins in one model (the fused attention, then the GQA one): one run for both.
  rope_flat / rope_per_head  partial rotary (GPT-NeoX's rotary_pct: ROT = 4 of each head's 8 dims)
                 on q and k column-parallel by heads (plan: local outputs). The mistake: the rotary
                 applied to the first ROT columns of the rank's FLAT projection before the view into
                 heads - at TP=1 that is head 0's first dims, at TP=2 rank 1 also rotates its own
                 first head (global head 2): the TP=2 model computes another function. Twin: each
                 head's first ROT dims.

    tpdiag compare --model py:tests/models/planted/attn_split.py:qkv_wholesale --tp 1,2
tests/test_attn_split.py; docs/planted.md has every case's verdict.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HEADS, BATCH, SEQ = 32, 32, 4, 2, 8
HD = DIM // HEADS


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _attend(q, k, v):
    """[b, s, h, hd] each -> [b, s, h * hd]."""
    b, s = q.shape[:2]
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return y.transpose(1, 2).reshape(b, s, -1)


class FusedAttn(nn.Module):
    def __init__(self, per_head: bool):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.per_head = per_head

    def forward(self, x):
        b, s, _ = x.shape
        y = self.qkv(x)  # at TP > 1 this rank's block of the fused rows (the plan's local output)
        if self.per_head:  # rows grouped per head: a block of rows is whole heads
            q, k, v = y.view(b, s, -1, 3 * HD).split(HD, -1)
        else:  # the mistake: [q | k | v] cut by the LOCAL width
            q, k, v = (t.reshape(b, s, -1, HD) for t in y.chunk(3, -1))
        return self.o(_attend(q, k, v))


class FusedLM(nn.Module):
    def __init__(self, per_head):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = FusedAttn(per_head)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.attn(h)))


def _fused(per_head):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=FusedLM(per_head), plan={"attn.qkv": ColwiseParallel(), "attn.o": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=_tokens)


def qkv_wholesale():
    return _fused(False)


def qkv_per_head():
    return _fused(True)


ROT = HD // 2


def _rotate(x):
    """RoPE on the last dim of x ([b, s, ..., ROT]) at positions 0..s-1."""
    s = x.shape[1]
    inv = 1.0 / (10000 ** (torch.arange(0, ROT, 2, dtype=torch.float32) / ROT))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None]  # [s, ROT/2]
    ang = ang.view(1, s, *([1] * (x.dim() - 3)), ROT // 2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


def _partial(x, per_head):
    """Rotary on the first ROT dims, the rest passed through."""
    if per_head:
        return torch.cat((_rotate(x[..., :ROT]), x[..., ROT:]), -1)
    b, s = x.shape[:2]
    flat = x.reshape(b, s, -1)  # the mistake: the first ROT columns of the rank's whole projection
    return torch.cat((_rotate(flat[..., :ROT]), flat[..., ROT:]), -1).view_as(x)


class RopeAttn(nn.Module):
    def __init__(self, per_head: bool):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.per_head = per_head

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, HD) for w in (self.wq, self.wk, self.wv))
        q, k = _partial(q, self.per_head), _partial(k, self.per_head)
        return self.wo(_attend(q, k, v))


class RopeLM(FusedLM):
    def __init__(self, per_head):
        super().__init__(per_head=True)
        self.attn = RopeAttn(per_head)


def _rope(per_head):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan["attn.wo"] = RowwiseParallel()
    return tpdiag.Target(model=RopeLM(per_head), plan=plan, vocab_size=VOCAB, inputs=_tokens)


def rope_flat():
    return _rope(False)


def rope_per_head():
    return _rope(True)


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, the ranks' partial input grads all-reduced in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


def sum_grad(p):
    """Each rank holds the whole parameter and uses its slice (or its heads): sum the grads."""
    def hook(g):
        if rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class GQAttn(nn.Module):
    """4 query heads, 1 kv head; every rank holds the whole weights and uses its query heads."""

    def __init__(self, kv_summed: bool):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.wk = nn.Parameter(torch.randn(HD, DIM) / DIM ** 0.5)
        self.wv = nn.Parameter(torch.randn(HD, DIM) / DIM ** 0.5)
        self.wo = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        for p in (self.wq, self.wo) + ((self.wk, self.wv) if kv_summed else ()):
            sum_grad(p)  # the mistake (kv_summed=False): the replicated kv head's grads left per rank

    def forward(self, x):
        r, n = rank_world()
        b, s, _ = x.shape
        rows = slice(r * DIM // n, (r + 1) * DIM // n)
        xs = _Copy.apply(x) if n > 1 else x
        q = (xs @ self.wq[rows].t()).view(b, s, -1, HD)
        k, v = ((xs @ w.t()).view(b, s, 1, HD).expand_as(q) for w in (self.wk, self.wv))
        out = _attend(q, k, v) @ self.wo[:, rows].t()
        return _Reduce.apply(out) if n > 1 else out


KV = 2


class GQA2Attn(nn.Module):
    """4 query heads, 2 kv heads; every rank holds the whole weights and uses its heads."""

    def __init__(self, round_robin: bool):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.wk = nn.Parameter(torch.randn(KV * HD, DIM) / DIM ** 0.5)
        self.wv = nn.Parameter(torch.randn(KV * HD, DIM) / DIM ** 0.5)
        self.wo = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        for p in (self.wq, self.wk, self.wv, self.wo):
            sum_grad(p)  # each rank's grad covers the rows (columns) it used
        self.round_robin = round_robin

    def forward(self, x):
        r, n = rank_world()
        b, s, _ = x.shape
        hq = HEADS // n
        cols = slice(r * hq * HD, (r + 1) * hq * HD)
        xs = _Copy.apply(x) if n > 1 else x
        q = (xs @ self.wq[cols].t()).view(b, s, hq, HD)
        if n <= KV:  # whole kv heads per rank
            kv = list(range(r * KV // n, (r + 1) * KV // n))
        else:  # kv_heads < TP: one kv head per rank, replicated; the mistake: round-robin
            kv = [r % KV if self.round_robin else r * KV // n]
        rows = torch.cat([torch.arange(h * HD, (h + 1) * HD) for h in kv])
        k, v = ((xs @ w[rows].t()).view(b, s, len(kv), HD).repeat_interleave(hq // len(kv), 2)
                for w in (self.wk, self.wv))
        out = _attend(q, k, v) @ self.wo[:, cols].t()
        return _Reduce.apply(out) if n > 1 else out


class GQALM(nn.Module):
    def __init__(self, kv_summed):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = GQAttn(kv_summed) if isinstance(kv_summed, bool) else GQA2Attn(kv_summed == "round_robin")
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.attn(h)))


class BothLM(FusedLM):
    def __init__(self):
        super().__init__(per_head=True)
        self.gqa = GQAttn(kv_summed=True)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(h)
        return self.head(self.norm(h + self.gqa(h)))


def gqa_rep_grad():
    return tpdiag.Target(model=GQALM(False), plan={}, vocab_size=VOCAB, inputs=_tokens)


def gqa_round_robin():
    return tpdiag.Target(model=GQALM("round_robin"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def gqa_blocked():
    return tpdiag.Target(model=GQALM("blocked"), plan={}, vocab_size=VOCAB, inputs=_tokens)


def gqa_rep_ok():
    return tpdiag.Target(model=GQALM(True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def attn_ok():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=BothLM(), plan={"attn.qkv": ColwiseParallel(), "attn.o": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=_tokens)
