"""invariant-vocab-softmax for a user's own loss: while on, F.cross_entropy on [tokens, vocab]
logits runs tpdiag's vocab-parallel cross-entropy (kernels/vocab_ce.py), whatever the logits'
layout - a vocab-sharded DTensor (under loss_parallel), a replicated DTensor, or a plain whole
tensor (TP=1) - so every degree sums the softmax in the same tree.

A TorchFunctionMode, as invariant-attention is: it catches the call however the user reached
it, with no change to their loop. tpdiag's own runner does not need it (it calls the kernel);
tpdiag.invariant installs it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tpdiag.errors import BadInput

CE = F.cross_entropy
_NAMES = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
          "label_smoothing")
WHAT = "invariant-vocab-softmax (F.cross_entropy)"


def _bind(args, kwargs) -> dict:
    b = dict(zip(_NAMES, args))
    for k, v in kwargs.items():
        if k not in _NAMES:
            raise BadInput(f"{WHAT}: unexpected argument {k!r}")
        b[k] = v
    for k, ok in (("weight", None), ("size_average", None), ("reduce", None)):
        if b.get(k, ok) is not ok:
            raise BadInput(f"{WHAT}: {k}= is not supported")
    if float(b.get("label_smoothing", 0.0)) != 0.0:
        raise BadInput(f"{WHAT}: label_smoothing is not supported")
    if b.get("reduction", "mean") not in ("mean", "sum", "none"):
        raise BadInput(f"{WHAT}: reduction={b['reduction']!r}: expected 'mean', 'sum' or 'none'")
    return b


def _local(logits):
    """(local logits, the number of ranks its vocab is split over: 1 when it is whole here)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(logits, DTensor):
        return logits, 1
    pl = tuple(logits.placements)
    if pl == (Replicate(),):
        return logits.to_local(), 1
    if len(pl) == 1 and isinstance(pl[0], Shard) and pl[0].dim % logits.ndim == logits.ndim - 1:
        return logits.to_local(), logits.device_mesh.size()
    raise BadInput(f"{WHAT}: logits placements {list(pl)} are not supported (vocab-sharded "
                   "Shard(-1) under loss_parallel, Replicate, or a plain tensor)")


def invariant_cross_entropy(logits, labels, *, ignore_index: int = -100, reduction: str = "mean"):
    from tpdiag.kernels import tree, vocab_ce

    if logits.ndim != 2 or labels.ndim != 1 or labels.is_floating_point():
        raise BadInput(f"{WHAT}: expected logits [tokens, vocab] and integer labels [tokens]; got "
                       f"{tuple(logits.shape)} and {tuple(labels.shape)} (flatten them first)")
    from torch.distributed.tensor import DTensor

    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    vocab = logits.shape[-1]
    local, split = _local(logits)
    groups = tree.check(vocab, split, f"{WHAT}: vocab")
    if ignore_index != vocab_ce.IGNORE:
        labels = torch.where(labels == ignore_index, torch.full_like(labels, vocab_ce.IGNORE), labels)
    if split == 1:
        with tree.local_only():  # every rank holds the whole vocab: one rank's computation
            lp = vocab_ce.VocabParallelLogProb.apply(local, labels, groups)
    else:
        lp = vocab_ce.VocabParallelLogProb.apply(local, labels, groups // split)
    valid = labels != vocab_ce.IGNORE
    if reduction == "none":
        return torch.where(valid, -lp, torch.zeros_like(lp)).to(logits.dtype)
    total = -lp.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    return (total / valid.sum().clamp_min(1)).to(logits.dtype)


class InvariantCrossEntropyMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not CE:
            return func(*args, **kwargs)
        b = _bind(args, kwargs)
        return invariant_cross_entropy(b["input"], b["target"], ignore_index=b.get("ignore_index", -100),
                                       reduction=b.get("reduction", "mean"))


@contextmanager
def invariant_cross_entropy_mode():
    mode = InvariantCrossEntropyMode()
    mode.__enter__()
    try:
        yield mode
    finally:
        mode.__exit__(None, None, None)
