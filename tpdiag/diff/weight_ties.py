"""A weight tie the plan split at a degree (models/ties.py), named at its first parameter's weight
grad (diff/analyse.py)."""
from __future__ import annotations

from tpdiag.diff.judge import describe


def broken_ties(entry: dict, rows: list[dict], broken: list, label: str) -> None:
    """A weight the reference shares between modules that this degree's plan split into separate
    parameters (models/ties.py): a sharding bug at the first such parameter's weight grad - its
    grad holds only its own module's uses - whatever its numbers' bound says."""
    for group in broken:
        names = [str(n) for n in group if isinstance(n, str)]
        row = next((r for r in rows for n in names if r["phase"] == "backward" and r["kind"] == "param_grad"
                    and f"{r['module']}.{r['name']}" == n), None)
        if row is None:
            continue
        f = {"phase": row["phase"], "module": row["module"], "op": None, "kind": row["kind"],
             "name": row["name"], "step": row["step"], "cause": None, "max_abs": row["max_abs"],
             "bound": row.get("bound"), "bound_ratio": row.get("bound_ratio"), "key": row["key"],
             "detail": f"the plan split the weight tie {' = '.join(names)} into {len(names)} parameters at "
                       f"TP={label}: each gets only its own module's grad (the reference sums every use "
                       "into one) and they are trained apart from the first optimizer step"}
        f = describe(row, f, broken_tie=True)
        entry["findings"] = [g for g in entry["findings"] if g.get("key") != row["key"]]
        entry["findings"].insert(0, f)
        entry["status"] = "divergent"
