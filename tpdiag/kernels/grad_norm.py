"""TP-invariant global grad norm and clipping.

Every grad can be bitwise equal across TP and the global norm still differ: each rank sums
squares over its shard and the all-reduce adds shards in a TP-dependent order. Here each grad
is gathered whole (an exact concatenation), squared and summed in float64 by one reduction of
the same shape at every TP, and the clip coefficient is rounded down to a power of two, so the
scaling itself is exact (Megatron's recipe plus the gather).
"""
from __future__ import annotations

import math

import torch


def grad_norm(params) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    sq = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        sq.append(g.detach().double().pow(2).sum())
    if not sq:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(sq).sum().sqrt()


def clip_coefficient(total: torch.Tensor, max_norm: float) -> float:
    coef = max_norm / (float(total) + 1e-6)
    if coef >= 1.0:
        return 1.0
    return 2.0 ** math.floor(math.log2(coef))


def grad_norm_and_clip(params, max_norm: float | None) -> torch.Tensor:
    params = list(params)
    total = grad_norm(params)
    if max_norm is not None:
        coef = clip_coefficient(total, max_norm)
        if coef != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return total
