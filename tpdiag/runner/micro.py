"""A micro-batched step: the global batch through the model in pieces of `micro_batch` sequences,
gradients accumulated over the pieces, one optimizer step - what a trainer with gradient
accumulation does.

Each piece's loss is its tokens' summed loss over the whole batch's token count, not its own
mean times a fraction: d loss / d token is then 1/N, the very value the reference's mean gives
every token, so a piece's backward starts from the reference's bits and anything that differs
later is the computation's own (a batch-variant kernel, the weight-grad sum split over pieces).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpdiag.errors import BadInput

IGNORE = -100


def split(batch, labels, micro_batch: int) -> list[tuple[object, torch.Tensor]]:
    """[(batch piece, labels piece)]: every tensor whose dim 0 is the batch's, cut along it."""
    rows = labels.shape[0]
    if not micro_batch or micro_batch >= rows:
        return [(batch, labels)]
    if rows % micro_batch:
        raise BadInput(f"--micro-batch {micro_batch}: must divide the batch's {rows} sequences")

    def cut(v, a, b):
        return v[a:b] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v

    out = []
    for a in range(0, rows, micro_batch):
        b = a + micro_batch
        if isinstance(batch, dict):
            piece = {k: cut(v, a, b) for k, v in batch.items()}
        elif isinstance(batch, tuple):
            piece = tuple(cut(v, a, b) for v in batch)
        else:
            piece = cut(batch, a, b)
        out.append((piece, labels[a:b]))
    return out


def piece_loss(target, loss_fn, logits, local_logits, labels, n_total, invariant_ce: bool):
    """One piece's share of the whole batch's mean loss (see the module's docstring)."""
    if target.loss is not None:
        # a user loss is opaque: its piece mean weighted by the piece's share of the tokens
        n = (labels != IGNORE).sum()
        return target.loss(local_logits, labels) * (n / n_total)
    if invariant_ce:
        from tpdiag.kernels import tree, vocab_ce

        lp = vocab_ce.token_logprobs(logits, labels, tree.n_groups(), target.vocab_size)
        return -(lp.sum() / n_total).to(logits.dtype)
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum") / n_total


def n_tokens(labels) -> torch.Tensor:
    return (labels != IGNORE).sum().clamp_min(1)
