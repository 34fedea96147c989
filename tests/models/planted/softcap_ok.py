"""A correct but unusual Gemma-2-style LM, split by a DTensor plan and the user's own vocab-parallel
loss (helper hred14): the embedding scaled by sqrt(hidden) in the model's dtype, attention by hand
with its scores soft-capped (`cap * tanh(s / cap)`) before a causal softmax, q/k/v
`ColwiseParallel()` and o `RowwiseParallel()` (heads split), a head `ColwiseParallel()` whose LOCAL
vocab shard is soft-capped (elementwise: right on a shard) and a Megatron-style vocab-parallel
cross-entropy over it. Nothing in it is wrong at any TP: rounding (or bitwise) only, never a BUG.
Vocab 32, hidden 32, 4 heads of 8, seq 8.

    tpdiag compare --model py:tests/models/planted/softcap_ok.py:softcap_ok --tp 1,2
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 32, 32, 4, 2, 8
HEAD_DIM = HIDDEN // HEADS
ATTN_CAP, FINAL_CAP = 50.0, 30.0


def tp():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _SumOverRanks(torch.autograd.Function):
    """Each rank's term of a sum over the vocabulary; every rank's loss uses the total."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def over_ranks(t):
    return _SumOverRanks.apply(t) if tp()[1] > 1 else t


class SoftcapAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5
        scores = ATTN_CAP * torch.tanh(scores / ATTN_CAP)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, -1))


class GemmaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.self_attn = SoftcapAttention()
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(HIDDEN ** 0.5, dtype=h.dtype)
        h = h + self.self_attn(self.input_layernorm(h))
        logits = self.lm_head(self.norm(h))  # this rank's vocab shard at TP > 1
        return FINAL_CAP * torch.tanh(logits / FINAL_CAP)


def vocab_parallel_ce(local_logits, labels):
    r, n = tp()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(over_ranks(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & (local < per) & keep
    target = over_ranks(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1) * inside)
    return ((lse - target) * keep).sum() / keep.sum()


def softcap_ok():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel()}
    return tpdiag.Target(model=GemmaLike(), plan=plan, vocab_size=VOCAB, loss=vocab_parallel_ce,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
