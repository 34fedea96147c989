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

Only a module that may have read the buffer: where the reference re-executed the module's call in
float64, that re-execution saw every tensor its ops read, and noted the buffers of other modules
among them, and any other tensor from outside its inputs and its own subtree (a value kept in a
shared object or a global, perhaps computed from the buffer): probes/float64.module_oracle. A call
that read neither is judged as any other - every module after the writer had been refused, and a
real bug in a later, unrelated layer (tests/models/planted/amax_then_bug.py) read `unknown`, named
at the buffer only. A call not re-executed, or a reference that noted no reads, is refused as
before. (What the notes see is the reference's own run: code that reads the buffer only at TP>1 is
not seen.)
"""
from __future__ import annotations

from tpdiag.records.keys import ROOTS


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
        if w["step"] != row["step"] or a == m or m in ROOTS or a.startswith(m + "."):
            continue  # the module's own subtree wrote it: its re-execution recomputes the write
        start = _started(dd, row["step"], a)
        if start is not None and start < row["idx"] and not _did_not_read(dd, row, w):
            return (f"it may read buffer {w['name']} of {a}, which {a}'s forward wrote earlier in this step and "
                    f"which differs ({w['key']}, judged at its own record): no input record holds what it read, "
                    "so its inputs are not known equal")
    return None


def _did_not_read(dd, row: dict, w: dict) -> bool:
    """The reference's float64 re-execution of row's module call ran, and read neither buffer w nor
    any tensor from outside its inputs and its own subtree (probes/float64.module_oracle)."""
    if not getattr(dd, "oracle_reads_noted", False):
        return False
    from tpdiag.records.keys import record_key

    step, m, call = int(row["step"]), row["module"], int(row["call"])
    if (step, m, call) not in _reexecuted(dd):
        return False
    notes = (getattr(dd, "oracle_notes", None) or {}).get(record_key(step, "forward", m, "oracle", call)) or {}
    if notes.get("why") or notes.get("reads_unnamed"):
        return False
    path = f"{w['module']}.{w['name']}"
    reads = set(notes.get("reads") or ())
    return path not in reads and not (w["module"] in ROOTS and w["name"] in reads)


def _reexecuted(dd) -> set:
    """(step, module, call) of every forward call the reference re-executed in float64 with an
    output it kept (whole or as norms)."""
    from tpdiag.records.keys import RecordKey

    ix = getattr(dd, "_reexec", None)
    n = len(getattr(dd, "oracle", None) or {}) + len(getattr(dd, "oracle_norms", None) or {})
    if ix is None or ix[0] != n:
        got = set()
        for k in list(getattr(dd, "oracle", None) or {}) + list(getattr(dd, "oracle_norms", None) or {}):
            p = RecordKey.parse(k)
            if p.phase == "forward" and p.kind == "out":
                got.add((p.step, p.module, p.call))
        ix = (n, got)
        try:
            dd._reexec = ix
        except AttributeError:
            pass
    return ix[1]


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
