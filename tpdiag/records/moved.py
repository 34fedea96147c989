"""Did a confirmation's first divergence move later than the one it confirmed? Both are compared in
the confirmed run's record order: the rerun's own `idx` numbers its records in the order its fix
wrote them, and a fix may write them in another order - invariant-gemm's and invariant-norm-grad's
fp32 carries write each carried weight's grad at the window's close, after the other grads. A bf16
Qwen3 at `--micro-batch 2,1`: the fixes made `lm_head`'s weight grad (idx 151) bitwise, and the next
divergence, `k_norm`'s weight grad (no carry: docs/micro-batch.md), came at the rerun's idx 151 too
(159 in the confirmed run) - read `not-confirmed`, 'so the cause label may be wrong'."""
from __future__ import annotations

import os


def record_order(run_dir: str, label: str) -> dict[str, int]:
    """{record key: idx} of one configuration of a run's diff.csv; {} where it has none yet."""
    from tpdiag.records.rundir import RunDir, read_rows

    path = RunDir(run_dir).diff_csv
    if not os.path.exists(path):
        return {}
    return {r["key"]: r["idx"] for r in read_rows(path)
            if r["degree"] == label and isinstance(r.get("idx"), int)}


def moved_later(before: dict, after: dict | None, order: dict[str, int]) -> bool:
    """after (the rerun's first divergence, None: none left) is later than before (the confirmed
    run's), in the confirmed run's order where it has after's record, else in the rerun's own."""
    if after is None:
        return True
    b = before.get("idx")
    a = order.get(after.get("key"), after.get("idx"))
    return isinstance(a, int) and isinstance(b, int) and a > b
