"""Mistakes in a user's PARALLEL code (hand-written Megatron-style layers, or a torchtitan-style
`{fqn: style}` plan), each beside its correct twin, trained a step as a user trains them (helper
hbug5). Vocab 32, hidden 32, seq 8: seconds per world on the CPU.

  embed_last / embed_ok  a hand-written vocab-parallel embedding (Megatron's VocabParallelEmbedding:
                 rank r owns rows [r V/N, (r+1) V/N), ids outside are masked to zero, the ranks'
                 rows summed). The mistake: the range's end written inclusive-minus-one
                 (`ids >= end - 1` masked), so the LAST id of every shard is masked on its own
                 rank too and its embedding is zero. At TP=1 that loses id V-1 only; at TP=2 also
                 id V/2-1: only a shard-edge id is wrong, and the batch holds them.
  split_loss_mean / split_loss_ok  the loss split over the TP ranks by positions (to keep one
                 rank's log-softmax small): each rank takes its slice of the positions of the
                 (replicated) logits through Megatron's `f` (the logits' grad all-reduced), and the
                 ranks' losses are combined. The mistake: each rank's MEAN over its own unmasked
                 tokens, the means averaged over the ranks - the prompt is masked, so the ranks
                 hold different counts and the average of means is not the mean. Twin: the sums
                 and the counts all-reduced, then divided.
  mega_dgrad / mega_bias / mega_ok  Megatron's ColumnParallelLinear and RowParallelLinear as a
                 user writes them: each rank holds only its SHARD of the weights (sliced from a
                 master weight drawn whole, as Megatron's CPU init does), the column layer's
                 GEMMs and its input-grad all-reduce in one autograd Function. mega_dgrad: that
                 backward forgets the all-reduce (the forward is exact; the input grad is each
                 rank's partial). mega_bias: the row-parallel layer adds its bias on every rank
                 before the all-reduce (TP times the bias). mega_ok, the twin, read BUG on
                 c4d0501 (tpdiag's own grad norm took the plain shards for replicas).
  plan_local_norm / plan_gather  a DTensor plan mistake that runs without an error: the MLP's
                 up projection marked `ColwiseParallel()` where its consumer, a non-affine
                 LayerNorm over the hidden width (NormFormer's FFN norm), expects the whole
                 width - each rank normalises its shard with the shard's own statistics. Twin:
                 `ColwiseParallel(output_layouts=Replicate())` (the shards gathered first).

    tpdiag compare --model py:tests/models/planted/parallel_code.py:mega_ok --tp 1,2
tests/test_parallel_code.py; docs/planted.md has every case's verdict.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ, PROMPT = 32, 32, 32, 2, 8, 3


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward (the output is replicated), identity backward."""

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


class _ScatterSeq(torch.autograd.Function):
    """Megatron's sequence-parallel scatter: this rank's slice of the positions; backward
    all-gathers the slices' grads."""

    @staticmethod
    def forward(ctx, x):
        r, n = rank_world()
        ctx.n, s = n, x.shape[1] // n
        return x[:, r * s:(r + 1) * s].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(ctx.n)]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, 1)


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


def sum_grad(p):
    """Each rank holds the whole parameter and uses its slice (or its positions): sum the grads."""
    def hook(g):
        if rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    p.register_hook(hook)


class VocabEmbedding(nn.Module):
    def __init__(self, last_masked: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM))
        self.last_masked = last_masked
        sum_grad(self.weight)

    def forward(self, ids):
        r, n = rank_world()
        per = VOCAB // n
        start, end = r * per, (r + 1) * per
        # the mistake: `end - 1` - the shard's last id counted as outside it
        outside = (ids < start) | (ids >= (end - 1 if self.last_masked else end))
        local = (ids - start).masked_fill(outside, 0)
        return reduce(F.embedding(local, self.weight[start:end]) * (~outside).unsqueeze(-1))


class MLP(nn.Module):
    """Column-parallel up, row-parallel down, by hand (every rank holds the whole weights)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)

    def forward(self, x):
        r, n = rank_world()
        cols = slice(r * HIDDEN // n, (r + 1) * HIDDEN // n)
        h = F.gelu(copy(x) @ self.up[cols].t())
        return x + reduce(h @ self.down[:, cols].t())


class HandLM(nn.Module):
    def __init__(self, last_masked=False):
        super().__init__()
        self.embed = VocabEmbedding(last_masked)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _tokens(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # every shard edge at TP=1,2 in the batch: the ids a wrong range gets wrong
    ids[0, 1:5] = torch.tensor([VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1, 0])
    return ids


def _prompt_masked(g):
    ids = _tokens(g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    labels[:, :PROMPT] = -100  # the response only: rank 0's half holds fewer tokens than rank 1's
    return {"tokens": ids, "labels": labels}


def split_loss(logits, labels, mean_of_means: bool):
    """Cross-entropy over this rank's slice of the positions, combined over the ranks."""
    r, n = rank_world()
    s = logits.shape[1] // n
    mine = copy(logits)[:, r * s:(r + 1) * s]  # f: the other ranks' positions' grads summed in
    y = labels[:, r * s:(r + 1) * s].flatten()
    nll = F.cross_entropy(mine.flatten(0, 1).float(), y, ignore_index=-100, reduction="sum")
    count = (y != -100).sum().to(nll.dtype)
    if n == 1:
        return nll / count
    if mean_of_means:  # the mistake: each rank's own mean, the means averaged
        return reduce(nll / count) / n
    return reduce(nll) / reduce(count)


class SeqLogitsLM(HandLM):
    """The head on this rank's positions only (sequence-parallel to the end): logits [B, S/TP, V]."""

    def forward(self, tokens):
        h = self.mlp(self.embed(tokens))
        return self.head(self.norm(_ScatterSeq.apply(h) if rank_world()[1] > 1 else h))


def seq_logits():
    """Not a mistake in the model: tpdiag reads every position's logits, and says so (exit 2)."""
    return tpdiag.Target(model=SeqLogitsLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def embed_last():
    return tpdiag.Target(model=HandLM(last_masked=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def embed_ok():
    return tpdiag.Target(model=HandLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def _split(mean_of_means):
    return tpdiag.Target(model=HandLM(), plan={}, vocab_size=VOCAB, inputs=_prompt_masked,
                         loss=lambda logits, labels: split_loss(logits, labels, mean_of_means))


def split_loss_mean():
    return _split(True)


def split_loss_ok():
    return _split(False)


class _ColumnFn(torch.autograd.Function):
    """y = x W^T + b on this rank's output columns; backward sums the ranks' input grads."""

    @staticmethod
    def forward(ctx, x, w, b, reduce_dgrad):
        ctx.save_for_backward(x, w)
        ctx.reduce_dgrad = reduce_dgrad
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = g @ w
        if ctx.reduce_dgrad and rank_world()[1] > 1:
            dist.all_reduce(dx)
        dw = g.flatten(0, -2).t() @ x.flatten(0, -2)
        return dx, dw, g.flatten(0, -2).sum(0), None


class ColumnParallelLinear(nn.Module):
    def __init__(self, d_in, d_out, reduce_dgrad=True):
        super().__init__()
        r, n = rank_world()
        rows = slice(r * d_out // n, (r + 1) * d_out // n)
        master = torch.randn(d_out, d_in) / d_in ** 0.5  # the same draw on every rank
        self.weight = nn.Parameter(master[rows].clone())
        self.bias = nn.Parameter(torch.zeros(d_out)[rows].clone() + 0.1)
        self.reduce_dgrad = reduce_dgrad

    def forward(self, x):
        return _ColumnFn.apply(x, self.weight, self.bias, self.reduce_dgrad)


class RowParallelLinear(nn.Module):
    def __init__(self, d_in, d_out, bias_before_reduce=False):
        super().__init__()
        r, n = rank_world()
        cols = slice(r * d_in // n, (r + 1) * d_in // n)
        master = torch.randn(d_out, d_in) / d_in ** 0.5
        self.weight = nn.Parameter(master[:, cols].clone())
        self.bias = nn.Parameter(torch.full((d_out,), 0.1))
        self.bias_before_reduce = bias_before_reduce

    def forward(self, x):
        if self.bias_before_reduce:  # the mistake: every rank's partial carries the whole bias
            return reduce(x @ self.weight.t() + self.bias)
        return reduce(x @ self.weight.t()) + self.bias


class MegatronMLP(nn.Module):
    def __init__(self, reduce_dgrad=True, bias_before_reduce=False):
        super().__init__()
        self.up = ColumnParallelLinear(DIM, HIDDEN, reduce_dgrad)
        self.down = RowParallelLinear(HIDDEN, DIM, bias_before_reduce)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class MegatronLM(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MegatronMLP(**kw)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def mega_ok():
    return tpdiag.Target(model=MegatronLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def mega_dgrad():
    return tpdiag.Target(model=MegatronLM(reduce_dgrad=False), plan={}, vocab_size=VOCAB, inputs=_tokens)


def mega_bias():
    return tpdiag.Target(model=MegatronLM(bias_before_reduce=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


class NormFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        h = F.gelu(self.up(x))
        # NormFormer's FFN norm, no affine: statistics over the whole hidden width
        h = F.layer_norm(h, h.shape[-1:])
        return x + self.down(h)


class PlanLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.ffn = NormFFN()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.ffn(self.embed(tokens))))


def plan_local_norm():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # the mistake: up's output left sharded although the norm after it reads the whole width
    return tpdiag.Target(model=PlanLM(), plan={"ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=_tokens)


def plan_gather():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=PlanLM(), plan={"ffn.up": ColwiseParallel(output_layouts=Replicate())},
                         vocab_size=VOCAB, inputs=_tokens)
