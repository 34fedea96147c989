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
from tpdiag.fixes.registry import carry_fixes
from tpdiag.runner.losses import upcast

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


def piece_loss(target, loss_fn, logits, local_logits, labels, n_total, invariant_ce: bool, rows_total=None):
    """One piece's share of the whole batch's mean loss (see the module's docstring)."""
    if target.loss is not None:
        # a user loss is opaque: its value on the piece, weighted as the whole batch's mean
        # weights the piece (Target.loss_mean): by its share of the tokens, of the sequences, or not
        mean = getattr(target, "loss_mean", "token")
        if mean == "sum":
            return target.loss(local_logits, labels)
        if mean == "sequence":
            return target.loss(local_logits, labels) * (labels.shape[0] / rows_total)
        n = (labels != IGNORE).sum()
        return target.loss(local_logits, labels) * (n / n_total)
    if invariant_ce:
        from tpdiag.kernels import tree, vocab_ce

        lp = vocab_ce.token_logprobs(logits, labels, tree.n_groups(), target.vocab_size)
        return -(lp.sum() / n_total).to(vocab_ce.loss_dtype(logits.dtype))
    # float32 from 16-bit logits, as the one-piece loss (runner/losses.default_loss)
    return F.cross_entropy(upcast(logits.flatten(0, -2)), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum") / n_total


def step_loss(lps: list[torch.Tensor], n_total, dtype) -> torch.Tensor:
    """The step's loss under invariant-vocab-softmax: every piece's fp32 token logprobs, in the
    reference's token order, reduced once as its invariant cross-entropy reduces them
    (vocab_ce.cross_entropy) - the reference's bits, where the pieces' shares added would be
    another summation order (the loss's counterpart of the weight grads' fp32 carry)."""
    from tpdiag.kernels.vocab_ce import loss_dtype

    return -(torch.cat(lps).sum() / n_total).to(loss_dtype(dtype))


def n_tokens(labels) -> torch.Tensor:
    return (labels != IGNORE).sum().clamp_min(1)


def carry_window(cfg, parts, device):
    """model -> the context every piece's forward and backward run in: grad accumulation's
    window when a carry fix is on and the step has a backward - in every world, the reference's
    one piece too (the same code, so the same bits at one piece or several) - else nothing."""
    from contextlib import nullcontext

    if not cfg.backward or not carry_fixes(cfg.fixes):
        return lambda model: nullcontext()
    from tpdiag.kernels import carry_ops, grad_carry

    if len(parts) > 1:
        tokens = parts[0][1].numel()
        block = carry_ops.piece_multiple(device)
        if tokens % block:
            raise BadInput(f"--micro-batch {cfg.micro_batch} with --fix {'/'.join(carry_fixes())}: a "
                           f"micro-batch holds {tokens} tokens; grad accumulation's fp32 carry walks "
                           f"the tokens in blocks of {block} on {device.type}, so every micro-batch must "
                           f"hold a multiple of {block} tokens (sequences x --seq-len)")
    return grad_carry.window
