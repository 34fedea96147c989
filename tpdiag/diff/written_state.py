"""A forward record that may read state written earlier in its own step (diff/oracle.apply asks).

A buffer written and read in the same step (FP8 current scaling: an observer module writes the amax,
a quantiser beside it reads that amax in the same forward) is recorded only after the step (kind
`buffer`), so no input record of its reader holds the value read: the reader's inputs read "bitwise
equal", its float64 re-execution - from the reference's buffer - was far, and the reader, whose code
is right, was named the BUG (tests/models/planted/amax_current.py:amax_sum: `mlp.quant`, 3e4x beyond
rounding, the wrong write at `mlp.observer` a later finding). Where a buffer written in the step is
itself wrong - its replicas differ, or its writer's float64 run is far from it - and its writer's
forward had started before a record of another module (not inside the writer's own subtree: that
module's re-execution recomputes the write), that record's inputs are not known equal: it is not
judged on them, and says why; the buffer's record is where the bug is named.
"""
from __future__ import annotations


def wrong_buffers(dd, forward_equal, verdict_for, writer_of) -> list[dict]:
    """The buffer rows written wrong in their step: replicas that differ, or far from the float64
    value their writer's re-execution left (its inputs equal)."""
    out = []
    for r in dd.rows:
        if r["kind"] != "buffer" or (r["bitwise"] and r.get("rank_consistent") is not False):
            continue
        if r.get("rank_consistent") is False:
            out.append(r)
            continue
        if r["key"] in (getattr(dd, "oracle", None) or {}) and forward_equal(dd, writer_of(dd, r), r["step"]):
            v = verdict_for(dd, r)
            if v is not None and v["far"] and not v.get("discrete"):
                out.append(r)
    return out


def read_after(dd, row: dict, wrong: list[dict]) -> str | None:
    """Why `row` (a forward record) may have read a wrong buffer written earlier in its step; None
    where none was."""
    if not wrong or row["phase"] != "forward":
        return None
    m = row["module"]
    for w in wrong:
        a = w["module"]
        if w["step"] != row["step"] or a == m or m == "model" or a.startswith(m + "."):
            continue  # the module's own subtree wrote it: its re-execution recomputes the write
        start = _started(dd, row["step"], a)
        if start is not None and start < row["idx"]:
            return (f"it may read buffer {w['name']} of {a}, which {a}'s forward wrote earlier in this step and "
                    f"which differs ({w['key']}, judged at its own record): no input record holds what it read, "
                    "so its inputs are not known equal")
    return None


def _started(dd, step: int, module: str) -> int | None:
    """The idx of the first forward record of the module's calls in that step (its input, before its
    forward ran; its output where it had no tensor input)."""
    ix = getattr(dd, "_started", None)
    if ix is None or ix[0] != len(dd.rows):
        got: dict = {}
        for r in dd.rows:
            if r["phase"] == "forward" and r["kind"] in ("in", "out"):
                got.setdefault((r["step"], r["module"]), r["idx"])
        ix = dd._started = (len(dd.rows), got)
    return ix[1].get((step, module))
