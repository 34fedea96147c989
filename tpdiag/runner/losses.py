"""The step's loss, logprob and grad-norm functions, and the context a vocab-sharded loss runs in."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from tpdiag.runner.batch import IGNORE


def default_loss(logits, labels):
    """The mean cross-entropy over the labelled tokens, in float32 from the logits upcast (an
    exact cast), as the user's trainer computes it: transformers' ForCausalLMLoss (`.loss`),
    torchtitan's cross_entropy_loss and Megatron's vocab-parallel cross-entropy all upcast first.
    A bf16 cross-entropy rounds each token's log-softmax to 8 bits and backpropagates another
    function's grads - not the user's step. A vocab shard (a DTensor under loss_parallel) keeps
    its placement through the cast. Memory: tokens x vocab x 4 bytes, as in the user's trainer."""
    return F.cross_entropy(upcast(logits.flatten(0, -2)), labels.flatten(), ignore_index=IGNORE)


def upcast(logits):
    """16-bit logits to float32 (exact); float32 and float64 as they are."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


# float32 elements of one upcast block of 16-bit logits: [T, V] is upcast a few hundred rows at a time
# (152k-wide vocab: ~440 rows, 256 MiB), never whole (8 x 4096 tokens of Llama 3's 128k vocab: 17 GB)
CHUNK_ELEMENTS = 1 << 26


def token_logprobs(logits, labels):
    """log p(label) per token, in float32 from the logits upcast (an exact cast) as RL trainers
    take them (NeMo RL, verl) and as engines report them (generate()'s output_logits, vLLM's
    sampler): a bf16 log-softmax rounds each logprob to 8 bits, and the logprob error between two
    degrees would be mostly that rounding (2 ULP of a bf16 logprob near -5 is 0.0625). Each row's
    log-softmax is its own, so blocks of rows give the whole tensor's bits. The vocab-parallel
    log-softmax runs on sharded logits (a DTensor: one call, the cast keeps its placement)."""
    lo, lab = logits.flatten(0, -2), labels.flatten()
    if lo.dtype not in (torch.bfloat16, torch.float16) or type(lo) is not torch.Tensor:
        # float32 or float64 as they are; a DTensor (a vocab shard under loss_parallel) in one call
        return -F.cross_entropy(upcast(lo), lab, ignore_index=IGNORE, reduction="none")
    rows = max(1, CHUNK_ELEMENTS // max(lo.shape[-1], 1))
    return torch.cat([-F.cross_entropy(lo[a:a + rows].float(), lab[a:a + rows], ignore_index=IGNORE,
                                       reduction="none") for a in range(0, lo.shape[0], rows)])


def grad_norm_and_clip(params, max_norm: float | None):
    """Global L2 norm of all grads (sharded ones reduced across ranks), clip if asked."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    whole = shard_norms([p for p in params if not isinstance(p, DTensor)], torch.float32)
    norms = []
    for p in params:
        if id(p) in whole:  # a plain shard: the norm of every rank's part (a rank may hold no grad)
            norms.append(whole[id(p)])
            continue
        if p.grad is None:
            continue
        n = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if max_norm is not None and norms:
        # as torch's clip_grad_norm_: the coefficient stays on the device (no host sync)
        from tpdiag.kernels.grad_norm import clip_grads

        clip_grads([p.grad for p in params if p.grad is not None], total, max_norm)
    return total


def shard_norms(params: list, dtype: torch.dtype) -> dict:
    """{id(param): the whole grad's norm} for the plain parameters whose grads differ between
    the ranks: each rank holds its own shard (Megatron's layers keep only their slice, a plain
    tensor with nothing saying so). A replica's grad is the same on every rank; one that a bug
    made differ per rank is combined the same way here, and named at its own grad record (a
    rank-inconsistent replica: tests/test_behind.py). Counting a shard's norm as a
    replica's makes each rank clip by another norm, and a correct model's replicas drift at the
    step - a BUG of tpdiag's making. Collectives: one for the count, one for five float64 numbers
    a parameter (whether it has a grad, three moments of it, its norm in `dtype`); none without a
    plain param. (A world here is one TP group: no data-parallel ranks whose grads differ.)"""
    import torch.distributed as dist

    from tpdiag.runner.per_rank import PER_RANK

    # parameters marked per-rank at build (runner/per_rank.mark_params: other bits or names per rank)
    # are normed over the ranks by update.py already: combining them here too counted them twice
    params = [p for p in params if not getattr(p, PER_RANK, False)]
    if not params or not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    from torch.utils._python_dispatch import _disable_current_modes

    # bookkeeping at TP > 1 only, not the step's computation: no op records of it (an op probe
    # numbers the optimizer's ops; ops TP=1 does not run would shift every later one)
    with _disable_current_modes():
        return _shard_norms(params, dtype)


def _shard_norms(params: list, dtype: torch.dtype) -> dict:
    import torch.distributed as dist

    dev = next((p.grad.device for p in params if p.grad is not None), None)
    if dev is None:  # no grad here (others may have some): the params' device
        dev = getattr(params[0], "device", torch.device("cpu"))
    f64, n = torch.float64, dist.get_world_size()
    count = torch.tensor([len(params)], device=dev)
    counts = [torch.empty_like(count) for _ in range(n)]
    dist.all_gather(counts, count)
    if any(int(c) != len(params) for c in counts):  # ranks of other structures: nothing to pair
        return {}
    rows = []
    for p in params:
        g = p.grad
        if g is None:
            rows.append(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=f64, device=dev))
            continue
        rows.append(torch.stack([torch.ones((), dtype=f64, device=g.device), g.sum(dtype=f64),
                                 torch.linalg.vector_norm(g, dtype=f64), g.flatten()[1::2].sum(dtype=f64),
                                 torch.linalg.vector_norm(g, dtype=dtype).to(f64)]).to(dev))
    mine = torch.stack(rows)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    out = {}
    for i, p in enumerate(params):
        if all(torch.equal(e[i, :4], mine[i, :4]) for e in every):
            continue
        # the ranks' norms (exact in float64), combined in rank order on every rank
        out[id(p)] = torch.linalg.vector_norm(torch.stack([e[i, 4] for e in every]).to(dtype))
    return out


def step_functions(target):
    """The loss, logprob and grad-norm functions, swapped for invariant ones by their fixes."""
    from tpdiag.fixes import registry

    loss_fn, logprob_fn, norm_fn = target.loss or default_loss, token_logprobs, grad_norm_and_clip
    if registry.takes_over("loss"):
        from tpdiag.kernels import tree, vocab_ce

        g, v = tree.n_groups(), target.vocab_size
        if target.loss is None:
            loss_fn = lambda lo, lab: vocab_ce.cross_entropy(lo, lab, g, v)  # noqa: E731
        else:  # a Target's own loss stays the user's, its F.cross_entropy the fix's
            loss_fn = _invariant_ce_in(target.loss)
        # the logprobs are tpdiag's own whoever wrote the loss: with a Target.loss they kept the stock
        # vocab-parallel log-softmax, so a correct policy's TP=2 logprobs under --fix all were not TP=1's
        logprob_fn = lambda lo, lab: vocab_ce.token_logprobs(lo, lab, g, v)  # noqa: E731
    if registry.takes_over("grad-norm"):
        from tpdiag.kernels import grad_norm

        norm_fn = _with_plain_shards(grad_norm.grad_norm_and_clip)
    return loss_fn, logprob_fn, norm_fn


def _invariant_ce_in(loss):
    """A Target.loss run with its F.cross_entropy calls taken over by invariant-vocab-softmax
    (fixes/vocab_loss.py), as tpdiag.invariant does in a user's own loop. Only that loop installed
    it: under `compare --fix all` a correct torchtitan-style loss (F.cross_entropy on loss-parallel
    logits, tests/models/user_tt25.py ok) kept torch's vocab-parallel softmax, 1 ULP from TP=1's
    loss, "a module the fix does not cover"."""
    import functools

    @functools.wraps(loss)
    def run(logits, labels):
        from tpdiag.fixes.vocab_loss import invariant_cross_entropy_mode

        with invariant_cross_entropy_mode():
            return loss(logits, labels)
    return run


def _with_plain_shards(norm_fn):
    """invariant-grad-norm's norm, with plain shards (shard_norms) normed over the ranks: their
    whole tensors cannot be rebuilt (nothing says along which dim they were cut), so that part
    of the norm is not TP-invariant - but it is the same on every rank, where the kernel alone
    would take each rank's shard as a whole grad. No plain shard: the kernel's own bits."""
    import functools

    from torch.distributed.tensor import DTensor

    @functools.wraps(norm_fn)  # still the kernel's norm (tests/test_fix_properties.py asks whose)
    def fn(params, max_norm):
        from tpdiag.kernels.grad_norm import clip_grads

        params = list(params)
        whole = shard_norms([p for p in params if not isinstance(p, DTensor)], torch.float64)
        if not whole:
            return norm_fn(params, max_norm)
        rest = norm_fn([p for p in params if id(p) not in whole], None)
        total = torch.linalg.vector_norm(torch.stack([rest.to(torch.float64), *whole.values()]))
        if max_norm is not None:
            clip_grads([p.grad for p in params if p.grad is not None], total, max_norm)
        return total
    return fn


def loss_context(world: int, parallel: bool = True):
    """loss_parallel() at TP > 1 where the logits are vocab-sharded (parallel: runner/logits.vocab_sharded)."""
    if world > 1 and parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()
