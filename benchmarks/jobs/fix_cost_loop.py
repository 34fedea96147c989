"""fix-cost --loop user: the public switch's cost in a user's own training loop.

Two configurations, interleaved in the same rounds as fix-cost's (benchmarks/jobs/fix_cost.py):
- "stock": what a user runs without tpdiag - torch's defaults (no deterministic algorithms:
  the process does not call tpdiag's determinism setup in this mode), `F.cross_entropy` under
  `loss_parallel`, a global-norm clip (`tpdiag.clip_grad_norm_` outside the switch: the ordinary
  float32 norm over DTensor and plain grads, torch's clip_grad_norm_ refuses that mix), AdamW;
- "tpdiag.invariant": the same loop inside `tpdiag.invariant(model, plan, fixes="all",
  tree_groups=G)` (G = the world's degree: one group per rank, group_gemm "per-group"), which
  also enters tpdiag.deterministic() - the whole switch as docs/training.md tells a user to use it.

The switch is entered before the step's timer starts and left after it stops (a user enters it
once around the loop), so a step's time is the step's alone. The environment a rank starts with
(CUBLAS_WORKSPACE_CONFIG=:4096:8, one CPU thread, NCCL_NVLS_ENABLE=0) is the same for both.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

CONFIGS = {"stock": False, "tpdiag.invariant": True}  # "stock": the loop without tpdiag


def user_step(model, target, fargs, fkwargs, labels, opt, sync, world: int, dev, cuda: bool):
    """step(on) -> seconds of one training step of the user's loop, with or without the switch."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import tpdiag
    from tpdiag.runner.logits import logits_of

    def step(on: bool) -> float:
        switch = (tpdiag.invariant(model, target.plan, fixes="all", tree_groups=world,
                                   group_gemm="per-group") if on else nullcontext())
        with switch:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            t = time.perf_counter()
            logits = logits_of(model(*fargs, **fkwargs))
            if isinstance(logits, DTensor):  # a vocab-sharded head: the loss is vocab-parallel
                from torch.distributed.tensor.parallel import loss_parallel

                ctx = loss_parallel()
            elif logits.shape[-1] != target.vocab_size:  # an unmarked local shard: no user loss
                raise ValueError(f"--loop user: the model's logits are a plain {logits.shape[-1]}-wide "
                                 f"shard of a {target.vocab_size} vocab; use a plan whose head "
                                 "returns a DTensor (use_local_output=False)")
            else:
                ctx = nullcontext()
            with ctx:
                loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
                loss.backward()
            tpdiag.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            return time.perf_counter() - t

    return step
