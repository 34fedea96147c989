"""Cause labels and their classes: the contract summary.json, the gate and the exit codes share.

Every cause is in one class (DESIGN.md, "Causes"): a **bug** is a wrong result (fix the code),
**non-finite** is NaN/Inf on one side only (never within any budget), **rounding** is a
reordered or re-blocked computation of the same function (harmless unless bitwise equality is
needed), and **unknown** means nothing could be judged (it always carries a reason).
"""
from __future__ import annotations

CAUSES = ("row-parallel-reduction", "shape-dependent-gemm", "vocab-parallel-softmax",
          "column-parallel-dgrad", "norm-weight-grad", "grad-norm", "collective-nondeterminism",
          "rank-inconsistent-replica", "router-flip", "sharding-bug", "unknown", "attention-kernel",
          "nondeterministic-kernel", "shape-dependent-kernel", "batch-variant-kernel", "non-finite")
BUG_CAUSES = ("sharding-bug", "rank-inconsistent-replica")
NONFINITE_CAUSES = ("non-finite",)
CLASSES = ("bug", "non-finite", "rounding", "unknown")

# Exit code of `gate` and `compare --fail-on-divergence` when a bug-class or non-finite finding is
# beyond policy (1 stays "divergence beyond policy", 2 inconclusive, 3 environment).
EXIT_BUG = 4


def cause_class(cause: str | None) -> str:
    if cause in BUG_CAUSES:
        return "bug"
    if cause in NONFINITE_CAUSES:
        return "non-finite"
    if cause is None or cause == "unknown":
        return "unknown"
    return "rounding"
