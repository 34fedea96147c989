"""The first record that the ranks together hold only part of (records/layout.ShortOfWhole), named
as a finding at it (diff/analyse.py): `sharding-bug` where every record compared before it was bitwise
equal, else `unknown`.

No reordering of a sum changes a shape: where a record's shards hold fewer elements than the reference's
record and nothing before it differed, the module computed over part of what the reference's computed
(a sequence-sharded input its plan declares replicated: each rank attends over its own positions only).
But a shape the model computes from VALUES - an MoE router's top-k deciding how many tokens an expert
module is called on, a mask's nonzero, a capacity - follows a rounding difference: a correct MoE whose
router flipped one token at TP=2 called an expert on 0 tokens where TP=1 called it on 1
(tests/models/planted/moe_expert_calls.py), read `sharding-bug`. Where a record before the break
differed already (summary.json shape_break `after`: the first such record), the shape judges nothing
either way: the finding is `unknown` (gate exit 1), saying so. Every record before it was compared as
usual; every record after it is left uncompared (diff/engine.py) - computed from it, so neither
rounding nor a bug of its own is shown there, and the degree's verdict is this finding's. The key and
`after` are re-derived from the records by the gate (diff/recheck.recomputed)."""
from __future__ import annotations

from tpdiag.diff.judge import describe


def brief(dd) -> dict | None:
    """summary.json's `shape_break` of a degree: the record's key and how many records after it were
    left uncompared - what the records alone give (the gate re-derives it: diff/recheck.py)."""
    brk = dd.shape_break
    if brk is None:
        return None
    after = sum(1 for u in dd.uncompared if u.get("why") == f"past the first record the ranks hold only part of ({brk['key']})")
    return {"key": brk["key"], "not_compared_after": after, "after": brk.get("after")}


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
    before = brk.get("after")
    why = brk["why"]
    if before is not None:
        why = (f"{why}; but a record before it differed already ({before}), and a shape the model computes "
               "from values (an MoE router's top-k deciding an expert's token count, a mask's nonzero, a "
               "capacity) changes with such a difference: the shape alone shows neither a sharding bug nor "
               "rounding - not judged")
    fields = {"phase": m["phase"], "module": module, "op": None, "kind": kind, "name": m["name"],
              "step": m["step"], "key": brk["key"], "idx": m["idx"], "cause": None, "root_cause": True,
              "max_abs": None, "max_ulp": None, "mismatch_fraction": None, "bound": None, "bound_ratio": None,
              "style": m.get("style"), "shape_break": True,
              "detail": (f"{where}; the {after} records after it are not compared (computed from it at this "
                         "degree): none of them is judged rounding")}
    row = {k: m.get(k) for k in ("key", "idx", "step", "phase", "module", "kind", "call", "name", "cls", "style")}
    finding = describe(row, dict(fields), short_of_whole=why, short_after=before)
    entry["findings"] = [f for f in entry["findings"] if f.get("key") != brk["key"]] + [finding]
    entry["status"] = "divergent"
    if not entry.get("first_divergence"):
        entry["first_divergence"] = describe(row, dict(fields), short_of_whole=why, short_after=before)
