"""More of a user's hand-written TP mistakes, each beside its correct twin (helper hbug7). Every
rank holds only its SHARD of a sharded weight (plain tensors sliced from a master drawn whole, as
Megatron's CPU init does); every collective is written with torch.distributed. Vocab 32, hidden 32,
seq 8: seconds per world on the CPU.

  gather_dim0 / gather_ok  a ColumnParallelLinear with `gather_output=True`, its gather written with
               `all_gather_into_tensor`, which stacks the ranks' shards along dim 0. The mistake:
               that [TP*B, S, H/TP] buffer viewed as [B, S, H] (the shards taken for column blocks
               of each row). Twin: viewed as [TP, B, S, H/TP] and the TP dim moved before the
               columns. The backward (this rank's columns of the grad) is right in both.
  vocab_pad / vocab_pad_ok  a vocabulary that TP does not divide (31 ids at TP=2), padded as Megatron
               pads it (`make_vocab_size_divisible_by`): the LM head holds ceil(V/TP) rows per rank,
               the padding rows zero. The mistake: the hand-written vocab-parallel cross-entropy
               leaves the padding's logits in the softmax (each adds exp(0 - max) to the sum). At
               TP=1 there is no padding. Twin: the padding's logits set to -inf first.
               vocab_split_ok: the same head and loss on 32 ids (no padding at TP=2).
               vocab_split_copy: vocab_split_ok's loss through Megatron's f (copy) by mistake: its
               grad all-reduced, every grad TP times.
  grad_sync_all / grad_sync_ok  a data-parallel style grad sync (each grad averaged over the default
               process group, DDP's way) in a job whose only group is the TP group. The mistake:
               every parameter is synced, the column and row shards too - each rank's shard grad
               becomes the average of DIFFERENT columns' grads. Twin: the shards are skipped (a
               replica's grad is the same on every rank: (g + g) / 2 is g, exactly).

    tpdiag compare --model py:tests/models/planted/tp_gathers.py:gather_dim0 --tp 1,2
tests/test_tp_gathers.py; docs/planted.md has every case's verdict.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 32, 2, 8
PAD_VOCAB = 31


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(master, dim):
    r, n = rank_world()
    per = master.shape[dim] // n
    return master.narrow(dim, r * per, per).clone()


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


def copy(t):
    return _Copy.apply(t) if rank_world()[1] > 1 else t


def reduce(t):
    return _Reduce.apply(t) if rank_world()[1] > 1 else t


class _GatherColumns(torch.autograd.Function):
    """Megatron's gather_from_tensor_model_parallel_region on the last dim, with
    all_gather_into_tensor (which concatenates along dim 0)."""

    @staticmethod
    def forward(ctx, y, as_rows):
        r, n = rank_world()
        ctx.r, ctx.per = r, y.shape[-1]
        out = y.new_empty((n * y.shape[0],) + tuple(y.shape[1:]))
        dist.all_gather_into_tensor(out, y.contiguous())
        if as_rows:  # the mistake: the dim-0 stack read as if the shards sat side by side
            return out.view(y.shape[:-1] + (n * ctx.per,))
        return out.view((n,) + tuple(y.shape)).movedim(0, -2).flatten(-2)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.r * ctx.per:(ctx.r + 1) * ctx.per].contiguous(), None


class GatheredColumn(nn.Module):
    """ColumnParallelLinear(gather_output=True): this rank's output columns, gathered whole."""

    def __init__(self, d_in, d_out, as_rows):
        super().__init__()
        self.weight = nn.Parameter(_shard(torch.randn(d_out, d_in) / d_in ** 0.5, 0))
        self.weight.tp_shard = True
        self.as_rows = as_rows

    def forward(self, x):
        y = copy(x) @ self.weight.t()
        return _GatherColumns.apply(y, self.as_rows) if rank_world()[1] > 1 else y


class GatherMLP(nn.Module):
    def __init__(self, as_rows):
        super().__init__()
        self.up = GatheredColumn(DIM, HIDDEN, as_rows)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class GatherLM(nn.Module):
    def __init__(self, as_rows):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = GatherMLP(as_rows)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _tokens(g, vocab=VOCAB):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def gather_dim0():
    return tpdiag.Target(model=GatherLM(True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def gather_ok():
    return tpdiag.Target(model=GatherLM(False), plan={}, vocab_size=VOCAB, inputs=_tokens)


class PaddedHead(nn.Module):
    """A vocab-parallel LM head over a padded vocabulary: ceil(V/TP) rows per rank."""

    def __init__(self, vocab):
        super().__init__()
        r, n = rank_world()
        self.per = -(-vocab // n)
        master = torch.cat([torch.randn(vocab, DIM) / DIM ** 0.5, torch.zeros(n * self.per - vocab, DIM)])
        self.weight = nn.Parameter(master[r * self.per:(r + 1) * self.per].clone())
        self.weight.tp_shard = True

    def forward(self, x):
        return copy(x) @ self.weight.t()


class PadLM(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = PaddedHead(vocab)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def padded_ce(local_logits, labels, vocab: int, mask_pad: bool):
    """Megatron's vocab-parallel cross-entropy on this rank's (padded) vocab shard."""
    r, n = rank_world()
    per = local_logits.shape[-1]
    z = local_logits.flatten(0, -2).float()
    real = min(max(vocab - r * per, 0), per)  # this rank's ids that exist
    if mask_pad and real < per:
        z = z.masked_fill(torch.arange(per, device=z.device) >= real, float("-inf"))
    y = labels.flatten()
    keep = y != -100
    m = z.detach().amax(-1, keepdim=True)
    if n > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(reduce(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    local = y - r * per
    inside = (local >= 0) & (local < per)
    target = reduce(z.gather(1, local.clamp(0, per - 1).unsqueeze(1)).squeeze(1) * (inside & keep))
    return ((lse - target) * keep).sum() / keep.sum()


def _pad(mask_pad, vocab=PAD_VOCAB):
    return tpdiag.Target(model=PadLM(vocab), plan={}, vocab_size=vocab, inputs=lambda g: _tokens(g, vocab),
                         loss=lambda logits, labels: padded_ce(logits, labels, vocab, mask_pad))


def vocab_pad():
    return _pad(False)


def vocab_pad_ok():
    return _pad(True)


def vocab_split_ok():
    return _pad(True, VOCAB)


def vocab_split_copy():
    """vocab_split_ok whose loss goes through Megatron's f (copy: identity forward, all-reduce
    backward) by mistake: the loss's grad, 1 on every rank, is summed to TP - every grad TP times,
    the loss and the logits as the twin's (helper hreview7)."""
    return tpdiag.Target(model=PadLM(VOCAB), plan={}, vocab_size=VOCAB, inputs=lambda g: _tokens(g, VOCAB),
                         loss=lambda logits, labels: copy(padded_ce(logits, labels, VOCAB, True)))


class RowLinear(nn.Module):
    """RowParallelLinear(input_is_parallel=True): this rank's input columns, partials all-reduced."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(_shard(torch.randn(d_out, d_in) / d_in ** 0.5, 1))
        self.weight.tp_shard = True
        self.bias = nn.Parameter(torch.full((d_out,), 0.1))

    def forward(self, x):
        return reduce(x @ self.weight.t()) + self.bias


class ShardMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(_shard(torch.randn(HIDDEN, DIM) / DIM ** 0.5, 0))
        self.up.tp_shard = True
        self.down = RowLinear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(copy(x) @ self.up.t()))


class SyncLM(nn.Module):
    def __init__(self, skip_shards):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = ShardMLP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        n = rank_world()[1]
        for p in self.parameters():
            if n > 1 and not (skip_shards and getattr(p, "tp_shard", False)):
                p.register_hook(_average)

    def forward(self, tokens):
        return self.head(self.norm(self.mlp(self.embed(tokens))))


def _average(g):
    """DDP's grad sync over the default group: the mean of the ranks' grads."""
    g = g.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def grad_sync_all():
    return tpdiag.Target(model=SyncLM(False), plan={}, vocab_size=VOCAB, inputs=_tokens)


def grad_sync_ok():
    return tpdiag.Target(model=SyncLM(True), plan={}, vocab_size=VOCAB, inputs=_tokens)
