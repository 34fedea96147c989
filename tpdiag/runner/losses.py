"""The step's loss, logprob and grad-norm functions, and the context a vocab-sharded loss runs in."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from tpdiag.runner.batch import IGNORE


def default_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)


def token_logprobs(logits, labels):
    """log p(label) per token; the vocab-parallel log-softmax runs on sharded logits."""
    lp = -F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE,
                          reduction="none")
    return lp


def grad_norm_and_clip(params, max_norm: float | None):
    """Global L2 norm of all grads (sharded ones reduced across ranks), clip if asked."""
    from torch.distributed.tensor import DTensor

    norms = []
    for p in params:
        if p.grad is None:
            continue
        n = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if max_norm is not None and norms:
        # as torch's clip_grad_norm_: the coefficient stays on the device (no host sync)
        from tpdiag.kernels.grad_norm import scale_grads

        scale_grads([p.grad for p in params if p.grad is not None],
                    torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def step_functions(target):
    """The loss, logprob and grad-norm functions, swapped for invariant ones by their fixes."""
    from tpdiag.fixes import registry

    loss_fn, logprob_fn, norm_fn = target.loss or default_loss, token_logprobs, grad_norm_and_clip
    if registry.takes_over("loss") and target.loss is None:
        from tpdiag.kernels import tree, vocab_ce

        g, v = tree.n_groups(), target.vocab_size
        loss_fn = lambda lo, lab: vocab_ce.cross_entropy(lo, lab, g, v)  # noqa: E731
        logprob_fn = lambda lo, lab: vocab_ce.token_logprobs(lo, lab, g, v)  # noqa: E731
    if registry.takes_over("grad-norm"):
        from tpdiag.kernels.grad_norm import grad_norm_and_clip as norm_fn
    return loss_fn, logprob_fn, norm_fn


def loss_context(world: int):
    if world > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()
