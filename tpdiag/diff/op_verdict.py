"""The first divergent op's float64 re-execution (diff/oracle.py) as evidence about a first
divergence its module record could not judge (an input that differs: the op is in the parent's
own code). Which cause it makes is the judge's (diff/judge.py: bug when far, the reordering its
op kind names when near)."""
from __future__ import annotations


def op_verdict(fd: dict, op_row: dict) -> dict:
    """Put the op's float64 verdict and the bound it implies on `fd`; returns the verdict."""
    v = op_row["oracle"]
    fd["op_oracle"] = v
    if v["far"] and v.get("discrete"):
        return v  # a discrete choice on floating values: far says nothing about a bound
    fd["bound_ratio"] = v["ratio"]
    fd["bound_model"] = "float64 re-execution of the op"
    return v
