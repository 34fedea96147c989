"""TP-invariant vocab-parallel log-softmax / cross-entropy.

The max and the target logit are exact under any all-reduce (a max; one nonzero plus zeros).
The sum of exp(logit - max) is not: each rank's partial sum and the all-reduce order change
with TP. Here the vocab is cut into fixed global groups, each summed by one reduction of the
same shape at every TP, and the groups are added by one tree across ranks (kernels/tree.py).
On CUDA the per-group sums are one Triton kernel (vocab_ce_triton.py); on the CPU, torch ops.
"""
from __future__ import annotations

import torch

from tpdiag.kernels import vocab_ce_triton
from tpdiag.kernels.tree import local_only, rank, tree_all_reduce, tree_sum, world_size

IGNORE = -100


def _all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    if world_size() == 1:
        return t
    import torch.distributed as dist

    from tpdiag.base.gloo_release import all_reduce_settled

    all_reduce_settled(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t


def torch_group_exp_sums(l: torch.Tensor, m: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """The torch (CPU) path: one reduction per group, each of the same shape at every TP. exp is
    elementwise, so a group's exp(l - m) has the bits it has inside the whole; only one group's
    fp32 copy exists at a time (never the whole [T, V] in fp32)."""
    return [torch.exp(lg.float() - m[:, None]).sum(dim=-1) for lg in l.chunk(groups, dim=-1)]


def group_exp_sums(logits, m, groups: int) -> list[torch.Tensor]:
    """Per-group sums of exp(l - m), [T] each. CUDA (or TPDIAG_TRITON_CPU=1): the Triton kernel,
    which reads the logits in their own dtype and never materialises exp(l - m); both paths
    are TP-invariant, each with its own (fixed) order, so a run must not mix them."""
    if vocab_ce_triton.triton_path(logits):
        return list(vocab_ce_triton.group_exp_sums(logits, m, groups).unbind(0))
    return torch_group_exp_sums(logits, m, groups)


# fp32 elements of one backward chunk: the [T, V] grad is built a few hundred token rows at a
# time (152k-wide vocab: ~440 rows, 256 MiB), so backward never holds [T, V] fp32 temporaries
CHUNK_ELEMENTS = 1 << 26


class VocabParallelLogProb(torch.autograd.Function):
    """logits_local [T, V_r] -> log p(label) [T] in fp32 (0 where label == IGNORE).

    Memory: the logits are saved as they are (16-bit for a bf16 model), not as an fp32 copy; the
    fp32 values are recomputed from them where needed (an exact upcast). Every number is the one
    the whole-tensor fp32 formula gives, bit for bit (tests/test_vocab_ce_memory.py)."""

    @staticmethod
    def forward(ctx, logits, labels, local_groups: int):
        v_r = logits.shape[-1]
        start = rank() * v_r
        # the max of the 16-bit values, then upcast: the same number as the max of their upcasts
        m = _all_reduce(logits.max(dim=-1).values.float().contiguous(), "max")
        s = tree_all_reduce(tree_sum(group_exp_sums(logits, m, local_groups)))
        lse = m + torch.log(s)
        valid = labels != IGNORE
        local = (labels >= start) & (labels < start + v_r) & valid
        idx = torch.where(local, labels - start, torch.zeros_like(labels))
        tgt = torch.where(local, logits.gather(-1, idx[:, None]).squeeze(-1).float(), torch.zeros_like(lse))
        tgt = _all_reduce(tgt.contiguous(), "sum")
        lp = torch.where(valid, tgt - lse, torch.zeros_like(lse))
        ctx.save_for_backward(logits, lse, idx, local, valid)
        return lp

    @staticmethod
    def backward(ctx, g):
        logits, lse, idx, local, valid = ctx.saved_tensors
        g = torch.where(valid, g.float(), torch.zeros_like(g.float()))
        t, v = logits.shape
        d = torch.empty_like(logits)
        rows = max(1, CHUNK_ELEMENTS // max(v, 1))
        for a in range(0, t, rows):
            b = min(t, a + rows)
            # d = g * (onehot - p): -p everywhere, then 1 + (-p) at the label (IEEE: 1 - p is
            # 1 + (-p), the same bits), times g, rounded once to the logits' dtype
            q = torch.exp(logits[a:b].float() - lse[a:b, None]).neg_()
            q.scatter_add_(-1, idx[a:b, None], local[a:b, None].float())
            d[a:b] = q.mul_(g[a:b, None])
        return d, None, None


def token_logprobs(logits, labels, groups: int, vocab_size: int | None = None):
    """logits: [..., V] plain tensor (TP=1 or replicated) or vocab-sharded DTensor / local shard;
    returns [N] fp32."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        logits = logits.to_local()
    lo = logits.reshape(-1, logits.shape[-1])
    if vocab_size is not None and lo.shape[-1] == vocab_size:
        # every rank holds the whole vocab (a gathered LM head): one rank's computation
        with local_only():
            return VocabParallelLogProb.apply(lo, labels.reshape(-1), groups)
    return VocabParallelLogProb.apply(lo, labels.reshape(-1), groups // world_size())


def cross_entropy(logits, labels, groups: int, vocab_size: int | None = None):
    """Mean NLL over valid tokens: the token sum has the same shape at every TP. In float32 for
    16-bit logits, as the stock loss it stands in for (runner/losses.default_loss: the user's
    trainer upcasts); in the logits' dtype for wider ones."""
    lp = token_logprobs(logits, labels, groups, vocab_size)
    n = (labels.reshape(-1) != IGNORE).sum().clamp_min(1)
    return -(lp.sum() / n).to(loss_dtype(logits.dtype))


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The cross-entropy's dtype: float32 from 16-bit logits (an exact upcast), else their own."""
    return torch.promote_types(dtype, torch.float32)


def reference_logprobs(logits_full: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 reference on whole logits."""
    lo = logits_full.reshape(-1, logits_full.shape[-1]).double()
    lab = labels.reshape(-1)
    lp = torch.log_softmax(lo, -1).gather(-1, lab.clamp_min(0)[:, None]).squeeze(-1)
    return torch.where(lab != IGNORE, lp, torch.zeros_like(lp))
