"""Which op made the first divergence: the first divergent op recorded before the first divergent
module record (a module record is written after its ops), else one only this degree ran (a
collective), else one its parent's backward or its caller's own code computed earlier; and what
the float64 re-executions and the pick's source say about it (diff/locate.py reads these).
"""
from __future__ import annotations

from tpdiag.diff import oracle, reassembled
from tpdiag.diff.engine import DegreeDiff
from tpdiag.records.keys import ROOTS
from tpdiag.records.ops import PICK_OPS


def _first_op(dd: DegreeDiff, first: dict) -> dict | None:
    """The op that produced the difference: the first divergent op recorded between the
    previous module record and `first` (a module record is written after its ops); failing
    that, the first op in that window that has no reference value (a TP-only collective)."""
    rows = dd.rows
    i = rows.index(first)
    start, lo = oracle.op_window(rows, i)
    window = rows[start:i]
    hit = next((r for r in window if not r["bitwise"]), None)
    # a pick only this degree records (a rank slicing its shard of a parameter: a full slice at
    # TP=1 dispatches no op) computes nothing: it is not where a difference enters
    extra = sorted((m for m in dd.uncompared if lo < m["idx"] < first["idx"]
                    and m["why"] in ("only at this degree", "collective output before wait_tensor")
                    and not _is_pick(m)),
                   key=lambda m: m["idx"])
    # a collective whose gathered result is bitwise a value the reference computed let no difference in
    hi = hit["idx"] if hit is not None else first["idx"]
    extra = [m for m in extra if not (m["name"].startswith("c10d::") and reassembled.exact(m, dd.uncompared, hi))]
    if extra and (hit is None or extra[0]["idx"] < hit["idx"] and extra[0]["name"].startswith("c10d::")):
        # a hand-written in-place collective ran before the first differing shared op: the
        # difference entered through it (its own output is not comparable)
        return extra[0]
    if hit is None and not extra:
        hit = _earlier_op(rows, start - 1, first)
    return hit


def _caller_verdict(dd: DegreeDiff, first: dict, fd: dict) -> dict | None:
    """For an input that differs: the float64 verdict on its caller's output, re-executed from the
    caller's inputs - bitwise equal at both sides, as every record before `first` is."""
    if first["kind"] != "in" or first["phase"] != "forward":
        return None
    out = next((r for r in dd.rows if r["phase"] == "forward" and r["kind"] == "out" and r["module"] == fd["module"]
                and r["step"] == first["step"] and r["idx"] > first["idx"]), None)
    v = (out or {}).get("oracle")
    if not isinstance(v, dict) or "far" not in v or v.get("own") or not oracle.inputs_equal(dd, out):
        return None
    inner = _inner_far(dd, first, out, fd["module"]) if v["far"] else None
    far_op = _first_far_op(dd, first, out, fd["module"]) if v["far"] and not inner else None
    return {**v, "record": out["key"], **({"explained_by": inner} if inner else {}),
            **({"far_op": far_op} if far_op else {})}


def _first_far_op(dd: DegreeDiff, first: dict, out: dict, caller: str) -> dict | None:
    """Where in a far caller's own code the wrong value enters: the first of its ops (that call, that
    step's forward) whose output is far from its float64 re-execution from the reference's inputs.
    The caller's first op that differs can be a harmless reordering before it (a complex RoPE product
    vectorised by the rank's head count, 587 ULP): named alone it sent the user to the rotary line
    while the bug was a GQA `repeat` three lines on (tests/models/planted/gqa_tiled.py). Its inputs
    carry that rounding, so this names a place to look, not a second verdict: the verdict stays the
    caller's own, whose inputs were equal."""
    call = None
    for r in dd.rows[:dd.rows.index(out)]:
        if r["kind"] != "op" or r["module"] != caller or r["step"] != first["step"] or r["phase"] != "forward":
            continue
        if call is None and not r["bitwise"]:
            call = r.get("call")
        if call is None or r.get("call") != call or r["bitwise"]:
            continue
        # only the first divergent op carries its verdict (its inputs alone are equal); the later
        # ones are judged here against the reference's float64 op the same way
        v = r.get("oracle") or oracle.verdict_for(dd, r)
        if isinstance(v, dict) and v.get("far") and not v.get("discrete"):
            return {"op": r["name"].rsplit("#", 1)[0], "record": r["key"], "ratio": v["ratio"],
                    **({"at": r["at"]} if r.get("at") else {})}
    return None


def _inner_far(dd: DegreeDiff, first: dict, out: dict, caller: str) -> str | None:
    """A module the caller calls after computing the input `first` (its consumer, or a later one),
    itself far from its float64 re-execution from its OWN inputs: the caller's whole re-execution
    is far through it, and says nothing of the input (a Mamba2 mixer whose in-projection rounds at
    TP=4 and whose gated norm then cuts its groups wrong: the projection read as the bug)."""
    i, j = dd.rows.index(first), dd.rows.index(out)
    for r in dd.rows[i:j]:
        v = r.get("oracle")
        if r["phase"] == "forward" and r["kind"] == "out" and r["step"] == first["step"] \
                and (caller in ROOTS or r["module"].startswith(caller + ".")) \
                and isinstance(v, dict) and v.get("own") and v.get("far") and not v.get("discrete"):
            return r["key"]
    return None


def _is_pick(row: dict) -> bool:
    """An op record of a pick (its name less the call suffix is exactly one of PICK_OPS: aten::index
    is one, aten::index_put is not)."""
    return str(row.get("name")).rsplit("#", 1)[0] in PICK_OPS


def _pick_source_equal(dd: DegreeDiff, op_row: dict | None) -> bool | None:
    """For a pick (slice, select) of the model's own tensor: whether its source, recorded once
    beside it (probes/op_probe.py), is bitwise equal at both sides; None for any other op."""
    if op_row is None or op_row.get("kind") != "op" or not _is_pick(op_row):
        return None
    key = op_row["key"].rsplit(".", 1)[0] + ".src"
    src = next((r for r in dd.rows if r["key"] == key), None)
    return src is not None and src["bitwise"] and src.get("rank_consistent") is not False


def _caller_op(dd: DegreeDiff, first: dict, caller: str) -> dict | None:
    """An input that differs was computed in its caller's own code, which may have run before the
    sibling calls recorded between it and the input (RoPE rows picked before the embedding runs):
    the first divergent op of the caller itself in the same step's forward. Every module record
    before `first` is bitwise equal, so what it computed first differs there."""
    for r in dd.rows[:dd.rows.index(first)]:
        if r["kind"] == "op" and not r["bitwise"] and r["module"] == caller \
                and r["step"] == first["step"] and r["phase"] == "forward":
            return r
    return None


def _earlier_op(rows: list[dict], j: int, first: dict) -> dict | None:
    """A backward can compute a module's input grad before the hooks of sibling modules record
    theirs: one attention backward op returns dq, dk and dv, and wq's grad_out is recorded
    after wk's and wv's. So when nothing differs between the previous module record and
    `first`, the difference was made earlier, among the ops recorded inside its parent's
    backward: after the parent's own record (a module's backward ops come after its grad_out
    record) and past the siblings' records. The earliest divergent op there (every module
    record before `first` being bitwise equal). The walk stops at the parent's record, at any
    other module's record - further back, ops belong to other modules and can differ without
    being a cause (a rank's partial sum before its all-reduce) - and at a step or phase
    boundary."""
    parent = first["module"].rpartition(".")[0]
    found = None
    while j >= 0 and rows[j]["step"] == first["step"] and rows[j]["phase"] == first["phase"]:
        r = rows[j]
        if r["kind"] == "op":
            if not r["bitwise"]:
                found = r
        elif r["module"] == parent or r["module"].rpartition(".")[0] != parent:
            break
        j -= 1
    return found
