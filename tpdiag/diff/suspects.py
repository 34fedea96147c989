"""Which modules a degree's diff hands to the second pass for a closer look (runner/drill.py):
the hash-only records that moved far more than their inputs, and the modules no layout bound
judged although everything they saw was equal."""
from __future__ import annotations

from tpdiag.records.keys import ROOTS, record_key

# A hash-only record has no values to bound-check. Its norm still says how much it moved: a
# module whose output moved far more than its input (relative L2 norm difference, a lower bound
# on the relative error) is worth a look with whole tensors. This only picks modules for the
# region pass; the finding itself comes from the rounding bound there.
SUSPECT_MIN, SUSPECT_RATIO, MAX_SUSPECTS = 1e-3, 100.0, 8


def hash_suspects(rows: list[dict]) -> list[str]:
    by_key = {r["key"]: r for r in rows}
    scored = []
    for r in rows:
        if not r.get("hash_only") or r["bitwise"] or r["phase"] != "forward" or r["kind"] != "out":
            continue
        out = r.get("norm_rel_diff") or 0.0
        src = by_key.get(record_key(r["step"], "forward", r["module"], "in", r["call"], 0))
        if src is None:
            continue
        inp = 0.0 if src["bitwise"] else (src.get("norm_rel_diff") or 0.0)
        if out > SUSPECT_MIN and out > SUSPECT_RATIO * inp:
            scored.append((out / inp if inp > 0 else float("inf"), r["module"]))
    scored.sort(key=lambda x: -x[0])
    return sorted({m for _, m in scored[:MAX_SUSPECTS]})


MAX_UNJUDGED = 8


def unjudged_modules(dd) -> list[str]:
    """Modules whose forward output (or a buffer it wrote) differs although their inputs and
    parameters were equal, and that no layout bound judged: each is a root of its own (a bug in one
    branch does not explain another), and the second pass re-executes each in float64
    (runner/drill.py)."""
    from tpdiag.diff.locate import classify
    from tpdiag.diff.oracle import forward_equal, grads_equal, inputs_equal

    out, moved = [], []
    for r in dd.rows:
        if r["kind"] == "buffer" and not r["bitwise"] and r.get("rank_consistent") is not False \
                and not r.get("oracle") and r["module"] not in out and len(out) < MAX_UNJUDGED \
                and forward_equal(dd, r["module"], r["step"]):
            out.append(r["module"])  # state its forward wrote, wrong although all it read was equal
            continue
        if r["phase"] == "backward" and r["kind"] == "param_grad" and not r["bitwise"] \
                and r.get("rank_consistent") is not False and classify(r) == "unknown" \
                and r["module"] not in out and len(out) < MAX_UNJUDGED and grads_equal(dd, r):
            out.append(r["module"])  # a weight grad wrong although all its module saw was equal
            continue
        if r["phase"] != "forward" or r["kind"] != "out" or r["bitwise"]:
            continue
        m = r["module"]
        # a parent whose child's output already differed: the child is the root (and a whole
        # model's float64 re-execution is the costliest of all)
        inner = any(c.startswith(m + ".") or m in ROOTS for c in moved if c != m)
        moved.append(m)
        if inner or r.get("oracle") or r.get("beyond_bound") or r.get("rank_consistent") is False:
            continue
        if classify(r) != "unknown":  # named by its layout or judged by a bound
            continue
        if m not in out and inputs_equal(dd, r):
            out.append(m)
        if len(out) >= MAX_UNJUDGED:
            break
    return out
