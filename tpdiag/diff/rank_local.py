"""Per-rank values INSIDE a module whose output is one value on every rank: a submodule fed the
rank's own coordinates - a vocab-parallel embedding's `nn.Embedding` shard looked up with LOCAL ids
(id - the rank's range start, the ids outside masked to 0), its rows masked and all-reduced by the
module around it. The shard's input and output have the reference's shape and differ across the
ranks by design; they are the ranks' shares of the enclosing module's work, not replicas. Read
`rank-inconsistent-replica`, a BUG, on the correct twin of tests/models/planted/embed_padidx.py.

Marked (left uncompared, as a DTensor partial is) only where the enclosing module's call shows the
ranks' values were combined into the right one: its inputs are one value on every rank, its output
is one value on every rank and bitwise the reference's, or 1000x or more closer to it than the
record's copies are (partials._combined's test). A per-rank value that reaches the module's output
leaves it split or wrong there, and that record is judged; one that matters only to the backward
(a grad computed from it) shows in the backward's records."""
from __future__ import annotations

WHY = "the ranks' own values inside {a} (its inputs and output one value on every rank, its output {how})"


def inside_combined(rows: list, tensors: dict, uncompared: list) -> None:
    outs: dict = {}
    ins: dict = {}
    for r in rows:
        if r["phase"] == "forward" and r["kind"] == "out":
            outs.setdefault((r["step"], r["module"]), []).append(r)
        elif r["phase"] == "forward" and r["kind"] == "in":
            ins.setdefault((r["step"], r["module"], r.get("call")), []).append(r)
    keep = []
    for r in rows:
        if r["phase"] == "forward" and r["kind"] in ("in", "out") and r.get("rank_consistent") is False \
                and r.get("idx") is not None:
            how = _combined_by(r, outs, ins)
            if how is not None:
                uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call")
                                      if k in r}, "why": WHY.format(a=how[0], how=how[1])})
                tensors.pop(r["key"], None)
                continue
        keep.append(r)
    rows[:] = keep


def _combined_by(r: dict, outs: dict, ins: dict):
    """(ancestor, how) for the nearest enclosing module whose call made one right value of r's, else None."""
    m = r["module"]
    for i in range(1, m.count(".") + 1):
        a = m.rsplit(".", i)[0]
        # the ancestor's call that encloses r: its first output recorded after r
        after = [o for o in outs.get((r["step"], a), ()) if o.get("idx") is not None and o["idx"] > r["idx"]]
        if not after:
            continue
        o = min(after, key=lambda o: o["idx"])
        got = ins.get((r["step"], a, o.get("call")))
        if not got or any(x.get("rank_consistent") is not True for x in got):
            continue
        if o.get("rank_consistent") is not True:
            continue
        if o.get("bitwise"):
            return a, "bitwise the reference's"
        off = r.get("max_abs")
        if off and o.get("max_abs") is not None and o["max_abs"] * 1000 <= off:
            return a, "1000x or more closer to the reference than these values"
    return None
