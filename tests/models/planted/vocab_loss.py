"""A user's own vocab-parallel cross-entropy (Megatron's _VocabParallelCrossEntropy written out as an
autograd Function) over a hand-written column-parallel LM head, each mistake beside its correct
twin (helper hbug8). The forward is right in every case; the backward is the user's own, so only
the logits' grad can be wrong - and only one rank's shard of it. Vocab 32, hidden 32, seq 8.

  vce_ok       the Function as Megatron writes it: local max, all-reduce MAX, local exp sum,
               all-reduce, the target logit masked by this rank's vocab range, all-reduced; the
               backward is softmax - one-hot(target) on this rank's columns.
  vce_onehot   the last rank's backward forgets to subtract the one-hot (grad = softmax there).
  vce_scale    the last rank's grad multiplied by the world size (a grad_output it all-reduced).
  vce_stale    the last rank's backward uses its LOCAL softmax (exp over its local exp sum, saved
               before the all-reduce), the other ranks the right one.

    tpdiag compare --model py:tests/models/planted/vocab_loss.py:vce_onehot --tp 1,2
tests/test_vocab_loss.py; docs/planted.md has every case's verdict.
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
IGNORE = -100


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


class ColumnHead(nn.Module):
    """ColumnParallelLinear(parallel_output=True): this rank's vocab rows, its logits left local."""

    def __init__(self):
        super().__init__()
        r, n = rank_world()
        per = VOCAB // n
        self.weight = nn.Parameter((torch.randn(VOCAB, DIM) / DIM ** 0.5)[r * per:(r + 1) * per].clone())
        self.weight.tp_shard = True

    def forward(self, x):
        return (_Copy.apply(x) if rank_world()[1] > 1 else x) @ self.weight.t()


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = ColumnHead()

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def _all_reduce(t, op=None):
    if rank_world()[1] > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


class VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from this rank's vocab shard of the logits ([T, V/TP], float32)."""

    @staticmethod
    def forward(ctx, logits, target, mistake):
        r, n = rank_world()
        per = logits.shape[-1]
        m = _all_reduce(logits.amax(-1), dist.ReduceOp.MAX if n > 1 else None)
        z = logits - m.unsqueeze(-1)
        outside = (target < r * per) | (target >= (r + 1) * per)
        local = (target - r * per).masked_fill(outside, 0)
        picked = _all_reduce(z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0))
        e = z.exp()
        local_sum = e.sum(-1)
        s = _all_reduce(local_sum.clone())
        last = n > 1 and r == n - 1
        soft = e / (local_sum if mistake == "stale" and last else s).unsqueeze(-1)
        ctx.save_for_backward(soft, outside, local)
        ctx.mistake, ctx.last, ctx.n = mistake, last, n
        return s.log() - picked

    @staticmethod
    def backward(ctx, g):
        soft, outside, local = ctx.saved_tensors
        grad = soft.clone()
        if not (ctx.mistake == "onehot" and ctx.last):
            rows = torch.arange(grad.shape[0])
            grad[rows, local] -= (~outside).to(grad.dtype)
        grad = grad * g.unsqueeze(-1)
        if ctx.mistake == "scale" and ctx.last:
            grad = grad * ctx.n
        return grad, None, None


def vocab_parallel_loss(logits, labels, mistake=None):
    z, y = logits.flatten(0, -2).float(), labels.flatten()
    keep = y != IGNORE
    per_token = VocabParallelCE.apply(z, y.masked_fill(~keep, 0), mistake)
    return (per_token * keep).sum() / keep.sum()


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(mistake):
    return tpdiag.Target(model=LM(), plan={}, vocab_size=VOCAB, inputs=_tokens,
                         loss=lambda logits, labels: vocab_parallel_loss(logits, labels, mistake))


def vce_ok():
    return _target(None)


def vce_onehot():
    return _target("onehot")


def vce_scale():
    return _target("scale")


def vce_stale():
    return _target("stale")
