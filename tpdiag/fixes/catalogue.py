"""Registers the fixes DESIGN.md names. A fix without an implementation yet has install=None."""
from __future__ import annotations

from tpdiag.fixes.registry import Fix, register

register(Fix("tp-invariant-linear", ("row-parallel-reduction", "column-parallel-dgrad"),
             ("RowwiseParallel forward", "ColwiseParallel dgrad"),
             "one K-reduction order at every TP"))
register(Fix("invariant-gemm", ("shape-dependent-gemm",), ("aten::mm", "aten::addmm"),
             "fixed-tile GEMM, no split-K"))
register(Fix("invariant-vocab-softmax", ("vocab-parallel-softmax",), ("vocab-parallel cross-entropy",),
             "one all-gather of per-shard exp-sums"))
register(Fix("invariant-norm-grad", ("norm-weight-grad",), ("RMSNorm weight grad",),
             "all-gather per-token terms"))
register(Fix("invariant-grad-norm", ("grad-norm",), ("global grad norm",),
             "float64 norm, power-of-two clip coefficient"))
register(Fix("deterministic-collectives", ("collective-nondeterminism",), ("all_reduce",),
             "fixed-order reduction"))
