"""The first record that the ranks together hold only part of (records/layout.ShortOfWhole), named
as a `sharding-bug` finding at it (diff/analyse.py).

No rounding changes a shape: where a record's shards hold fewer elements than the reference's
record, the module computed over part of what the reference's computed (a sequence-sharded input
its plan declares replicated: each rank attends over its own positions only). Every record before
it was compared as usual; every record after it is left uncompared (diff/engine.py) - computed from
it, so neither rounding nor a bug of its own is shown there, and the degree's verdict is this
finding's. The key is re-derived from the records by the gate (diff/recheck.recomputed)."""
from __future__ import annotations

from tpdiag.diff.judge import describe


def brief(dd) -> dict | None:
    """summary.json's `shape_break` of a degree: the record's key and how many records after it were
    left uncompared - what the records alone give (the gate re-derives it: diff/recheck.py)."""
    brk = dd.shape_break
    if brk is None:
        return None
    after = sum(1 for u in dd.uncompared if u.get("why") == f"past the first record the ranks hold only part of ({brk['key']})")
    return {"key": brk["key"], "not_compared_after": after}


def name(entry: dict, dd, other) -> None:
    """Add the finding for dd.shape_break to the degree's entry; it is the first divergence where
    every record compared before it was bitwise equal."""
    brk = dd.shape_break
    m = other.by_key[brk["key"]]
    entry["shape_break"] = brief(dd)
    after = entry["shape_break"]["not_compared_after"]
    module, kind = m["module"], m["kind"]
    if kind == "in" and m["phase"] == "forward":
        where = (f"the input of {module} already holds part of the reference's: the code that called it "
                 f"({module.rpartition('.')[0] or 'the model'}) computed it")
    else:
        where = f"the {kind} of {module} holds part of the reference's although every record before it gathered"
    fields = {"phase": m["phase"], "module": module, "op": None, "kind": kind, "name": m["name"],
              "step": m["step"], "key": brk["key"], "idx": m["idx"], "cause": None, "root_cause": True,
              "max_abs": None, "max_ulp": None, "mismatch_fraction": None, "bound": None, "bound_ratio": None,
              "style": m.get("style"), "shape_break": True,
              "detail": (f"{where}; the {after} records after it are not compared (computed from it at this "
                         "degree): none of them is judged rounding")}
    row = {k: m.get(k) for k in ("key", "idx", "step", "phase", "module", "kind", "call", "name", "cls", "style")}
    finding = describe(row, dict(fields), short_of_whole=brk["why"])
    entry["findings"] = [f for f in entry["findings"] if f.get("key") != brk["key"]] + [finding]
    entry["status"] = "divergent"
    if not entry.get("first_divergence"):
        entry["first_divergence"] = describe(row, dict(fields), short_of_whole=brk["why"])
