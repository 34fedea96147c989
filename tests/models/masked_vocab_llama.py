"""A user's tiny Llama whose vocabulary is padded (100 real ids, the config's vocab_size rounded up
to 128, as vLLM, Megatron and several HF checkpoints do) and whose forward masks the padding's
logits to -inf, so the logits tpdiag records carry -inf columns on both sides. The LM head is
vocab-parallel (torch's plain ColwiseParallel: each rank gets its own columns) and the user masks
their shard by its global column ids, as vLLM's padded vocab-parallel head does.

  masked_ok          correct: rounding only (the row-parallel all-reduces)
  masked_default     the same model with tpdiag's built-in cross-entropy (no Target.loss): rounding only
  masked_mask_local  the mask built from the LOCAL column ids (`arange(shard) >= shard - PAD`, as if
                     every rank's shard ended in padding): at TP=2 rank 0 masks 28 real ids - a
                     column -inf at TP=2 and finite at TP=1
  masked_loss_mean   a vocab-parallel cross-entropy that averages the ranks' exp sums where it must
                     add them (all-reduce, then / TP): every rank's loss is log(TP) low, its grads
                     right - only the loss says so

    tpdiag compare --model py:tests/models/masked_vocab_llama.py:masked_loss_mean --tp 1,2
tests/test_masked_vocab_compare.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

REAL, VOCAB, DIM, HEADS, FFN, BATCH, SEQ = 100, 128, 32, 4, 64, 2, 8
PAD = VOCAB - REAL


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: a column-sharded projection holds HEADS / TP of them
        q, k, v = (p(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, FFN, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(DIM), Attention()
        self.post_attention_layernorm, self.mlp = RMSNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class PaddedLlama(nn.Module):
    def __init__(self, local_mask=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.local_mask = local_mask

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))  # this rank's columns of the padded vocab
        r, n = rank_world()
        shard = logits.shape[-1]
        if self.local_mask:
            pad = torch.arange(shard, device=logits.device) >= shard - PAD
        else:
            pad = torch.arange(r * shard, (r + 1) * shard, device=logits.device) >= REAL
        return logits.masked_fill(pad, float("-inf"))


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def _reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def vocab_parallel_ce(local_logits, labels, mean_sum=False):
    """Megatron's vocab-parallel cross-entropy on this rank's columns; the padding is -inf already."""
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    s = _reduce(torch.exp(z - m).sum(-1))
    lse = torch.log(s / n if mean_sum else s) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & (local < per) & keep
    target = _reduce(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0))
    return ((lse - target) * keep).sum() / keep.sum()


def plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    a, m = "layers.*.self_attn.", "layers.*.mlp."
    return {a + "q_proj": ColwiseParallel(), a + "k_proj": ColwiseParallel(), a + "v_proj": ColwiseParallel(),
            a + "o_proj": RowwiseParallel(), m + "gate_proj": ColwiseParallel(), m + "up_proj": ColwiseParallel(),
            m + "down_proj": RowwiseParallel(), "lm_head": ColwiseParallel()}


def _target(loss=None, **kw):
    # the data holds real token ids only: the padding's ids are no tokens
    return tpdiag.Target(model=PaddedLlama(**kw), plan=plan(), vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, REAL, (BATCH, SEQ), generator=g), loss=loss)


def masked_ok():
    return _target(loss=vocab_parallel_ce)


def masked_mask_local():
    return _target(loss=vocab_parallel_ce, local_mask=True)


def masked_loss_mean():
    return _target(loss=lambda lo, lab: vocab_parallel_ce(lo, lab, mean_sum=True))


def masked_default():
    return _target()
