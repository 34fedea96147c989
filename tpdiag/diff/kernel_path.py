"""`shape-dependent-kernel`: a module with no layout whose output moved although every input and
parameter it has is bitwise equal to the reference's, by a few ULP.

Only for a leaf module whose own parameters are at most vectors (an activation, XIELU's scalar
alphas, a per-head norm's weight): a module with children or a weight matrix may reduce or run
a collective in its own code, where equal inputs prove nothing about one kernel.

A deterministic kernel given the same values computes the same function; if its bits still
differ, it took another code path, and what picks the path is the shape and strides of the
rank's local tensor. Seen on CPU (AVX-512, torch 2.13): an elementwise activation (SiLU of an
MoE expert's gate, a [tokens, I/TP] view of the packed gate_up output) runs its vectorised
body over whole 32-float chunks of each row and a scalar loop over the rest; at TP=4 a row of
16 floats is all scalar tail, and the scalar exp rounds differently from the vectorised one
(1-2 ULP on ~3% of the elements). That is the same family as `shape-dependent-gemm` (a GEMM
tiled by its shape), for a kernel that is no GEMM.

Judged only when it is that small: each side's library evaluates an elementwise function within
a few ULP of the exact value (libm and SLEEF promise <= 1 ULP per exp/log/tanh, and an
activation composes a handful of roundings), so two paths differ by at most PATH_ULPS ULP of
the larger result. A larger difference is not named (a module that reduces over a sharded
dimension, or rank-dependent code, would also give other bits from equal inputs): the cause
stays `unknown` with the reason. The reference's rerun against itself (`baseline`) has already
ruled out a kernel that is nondeterministic at a fixed shape.
"""
from __future__ import annotations

import torch

from tpdiag.diff.bits import bitwise_equal

PATH_ULPS = 8  # 4 per side: the composition of a few correctly rounded or <= 1-ULP operations


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t| (float64), subnormals included."""
    a = t.abs()
    up = torch.nextafter(a, torch.full_like(a, float("inf")))
    return (up.to(torch.float64) - a.to(torch.float64))


def judge(y1: torch.Tensor, yn: torch.Tensor, inputs: list, params: dict) -> dict | None:
    """{"bound", "why"?} when every input and parameter is bitwise equal at both sides (and there
    is at least one input), else None (another model must judge it). inputs: [(name, (ref,
    other))], params: {name: (ref, other)} - the module's own recorded values.
    With a "why", the difference is beyond PATH_ULPS and nothing is named."""
    if not inputs or not all(bitwise_equal(a, b) for _, (a, b) in inputs):
        return None
    if not all(bitwise_equal(a, b) for a, b in params.values()):
        return None
    if not y1.is_floating_point():
        return None
    spacing = torch.maximum(_ulp(y1), _ulp(yn))
    bound = PATH_ULPS * spacing
    d = (yn.to(torch.float64) - y1.to(torch.float64)).abs()
    if bool(torch.isnan(d).any()) or bool((d > bound).any()):
        return {"bound": bound, "why": (
            f"every input and parameter it has is bitwise equal to the reference's, yet its output "
            f"differs by more than {PATH_ULPS} ULP: more than another code path of one elementwise "
            "kernel explains (it may reduce over a sharded dimension, or run rank-dependent code)")}
    return {"bound": bound}
