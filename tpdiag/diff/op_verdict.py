"""The first divergent op, judged by its float64 re-execution (diff/oracle.py): bug or rounding,
and which reordering, for a first divergence its module record could not judge (an input that
differs: the op is in the parent's own code)."""
from __future__ import annotations

from tpdiag.diff.generic_bound import GEMM_OPS
from tpdiag.records.ops import ATTENTION_OPS, COLLECTIVE_OPS, is_op_of


def op_verdict(fd: dict, op_row: dict) -> None:
    """The first divergent op, re-executed in float64, judges a first divergence that its module
    record could not (an input that differs: the op is in the parent's own code)."""
    v = op_row["oracle"]
    fd["op_oracle"] = v
    fd.pop("why", None)
    op = op_row["name"].rsplit("#", 1)[0]
    if v["far"] and not v.get("discrete"):
        fd["cause"] = "sharding-bug"
        fd["bound_ratio"] = v["ratio"]
        fd["bound_model"] = "float64 re-execution of the op"
        return
    if v["far"]:
        fd["cause"] = "unknown"
        fd["why"] = (f"{op} is far from its float64 re-execution, but it makes a discrete choice on "
                     "floating values that a rounding difference can flip")
        return
    fd["bound_model"] = "float64 re-execution of the op"
    fd["bound_ratio"] = v["ratio"]
    base = op.split("::")[-1]
    if is_op_of(op, ATTENTION_OPS):
        fd["cause"] = "attention-kernel"
    elif base in GEMM_OPS:
        fd["cause"] = "shape-dependent-gemm"
    elif any(c in op for c in COLLECTIVE_OPS):
        fd["cause"] = "row-parallel-reduction"
    else:
        fd["cause"] = "shape-dependent-kernel"
