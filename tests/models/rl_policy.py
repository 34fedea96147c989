"""An RL team's own policy model, written as a team writes one: a small pre-norm transformer with
RoPE attention, its own KV cache for the rollout (gpt-fast style: `new_kv_cache()`,
`forward(ids, cache=...)`), its own TP plan, and its own vocab-parallel logprob for the trainer's
loss (the head stays sharded: each rank holds its slice of the vocabulary).

Targets (py:tests/models/rl_policy.py:NAME):
- policy: everything right. Decode vs prefill, micro-batch sizes and TP differ by rounding only.
- rope_decode_off1: the rollout path numbers its decode positions from cache.length + 1 (a
  position counter bumped before it is read): the prompt is right, every token after it is
  rotated one position too far. Wrong in decode only.
- lse_per_rank: the vocab-parallel logprob takes the logsumexp over the rank's own vocab shard
  and never all-reduces it (the picked logit is all-reduced, the normaliser is not). Right at
  TP=1, wrong at TP > 1, in the loss only (the logits are right).
- lse_per_rank_synced: the same, with the loss averaged over the ranks afterwards, so every rank
  holds the same (wrong) number.
- policy_bf16: `policy` with bf16 parameters (the rounding twin for bf16 runs).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

VOCAB, DIM, HEADS, FFN, LAYERS, MAX_LEN = 64, 32, 4, 64, 1, 32


def rope(dim, n, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def rotate(x, cos, sin):  # x [B, S, H, D], half-split rotation (HF style)
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([a * c - b * s, a * s + b * c], -1).type_as(x)


class Cache:
    def __init__(self, n):
        self.k = [None] * n
        self.v = [None] * n

    @property
    def length(self):
        return 0 if self.k[0] is None else self.k[0].shape[1]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x, cos, sin, cache=None, i=0):
        B, S, _ = x.shape
        hd = DIM // HEADS
        h = self.attn_norm(x)
        q = rotate(self.q(h).view(B, S, -1, hd), cos, sin)
        k = rotate(self.k(h).view(B, S, -1, hd), cos, sin)
        v = self.v(h).view(B, S, -1, hd)
        past = 0
        if cache is not None:
            if cache.k[i] is not None:
                past = cache.k[i].shape[1]
                k, v = torch.cat([cache.k[i], k], 1), torch.cat([cache.v[i], v], 1)
            cache.k[i], cache.v[i] = k, v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if past == 0:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the new queries see every cached key and the new keys up to their own position
            mask = torch.ones(S, past + S, dtype=torch.bool).tril(past)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, -1))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class Policy(nn.Module):
    def __init__(self, decode_offset=0):
        super().__init__()
        self.decode_offset = decode_offset
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        cos, sin = rope(DIM // HEADS, MAX_LEN + 2)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def new_kv_cache(self):
        return Cache(len(self.blocks))

    def forward(self, input_ids, cache=None):
        S = input_ids.shape[1]
        start = 0 if cache is None else cache.length
        if start:
            start += self.decode_offset
        cos, sin = self.cos[start:start + S], self.sin[start:start + S]
        h = self.embed(input_ids)
        for i, b in enumerate(self.blocks):
            h = b(h, cos, sin, cache, i)
        return self.head(self.norm(h))


def plan():
    return {"blocks.*.q": ColwiseParallel(), "blocks.*.k": ColwiseParallel(),
            "blocks.*.v": ColwiseParallel(), "blocks.*.o": RowwiseParallel(),
            "blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel(),
            "head": ColwiseParallel()}  # local vocab shards: our loss is vocab-parallel


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's reduce-from-model-parallel-region: sum in the forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _all_reduce(x):
    return _ReduceFromTP.apply(x)


def vocab_parallel_logprobs(local, labels, reduce_normaliser=True):
    """log p(label) from this rank's vocab shard of the logits (Megatron's way)."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    if tp == 1 or local.shape[-1] == VOCAB:
        x = local.float()
        return x.gather(-1, labels.clamp(min=0)[..., None])[..., 0] - x.logsumexp(-1)
    x = local.float()
    lo = dist.get_rank() * x.shape[-1]
    m = x.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    sumexp = (x - m).exp().sum(-1)
    if reduce_normaliser:
        sumexp = _all_reduce(sumexp)
    lse = m[..., 0] + sumexp.log()
    mine = (labels >= lo) & (labels < lo + x.shape[-1])
    picked = x.gather(-1, (labels - lo).clamp(0, x.shape[-1] - 1)[..., None])[..., 0] * mine
    return _all_reduce(picked) - lse


def _loss(reduce_normaliser, sync=False):
    def loss(logits, labels):
        lp = vocab_parallel_logprobs(logits, labels, reduce_normaliser)
        keep = labels != -100
        out = -(lp * keep).sum() / keep.sum()
        if sync and dist.is_initialized() and dist.get_world_size() > 1:
            out = _all_reduce(out) / dist.get_world_size()  # "keep the ranks in step": the mean of theirs
        return out
    return loss


def _target(model, reduce_normaliser=True, sync=False):
    return tpdiag.Target(model=model, plan=plan(), vocab_size=VOCAB, loss=_loss(reduce_normaliser, sync))


def policy():
    return _target(Policy())


def policy_bf16():
    return _target(Policy().to(torch.bfloat16))


def rope_decode_off1():
    return _target(Policy(decode_offset=1))


def lse_per_rank():
    return _target(Policy(), reduce_normaliser=False)


def lse_per_rank_synced():
    return _target(Policy(), reduce_normaliser=False, sync=True)
