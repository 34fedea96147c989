"""The first record that the ranks together hold only part of (records/layout.ShortOfWhole), named
as a finding at it (diff/analyse.py): `sharding-bug` where every record compared before it was bitwise
equal, else `unknown` - unless the code that made it could not let a value decide its shape (`settle`).

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
`after` are re-derived from the records by the gate (diff/recheck.recomputed).

But "a difference before it" alone is no excuse: a rounding difference changes a shape only through an
op that lets a value decide one (probes/value_shapes.py: nonzero, a boolean mask, `.item()`, `.tolist()`
...). The break is a `sharding-bug` after all (`by`, settle) where the code that made the record - its
module's forward for an output, the nearest called ancestor's for an input (the `producer`) - shows that
its shape could not follow from values:
  - `inputs-equal`: the producer's inputs and parameters at that call were bitwise the reference's and
    every record of the call before the break was too - the rule of a break with nothing before it,
    applied to the call that made it (the difference before it was elsewhere);
  - `shape-fixed`: the reference's float64 re-execution of that call (the second pass runs it:
    runner/drill.py) ran no such op and took no Python number argument, and each of its input records
    has the reference's shape here: the record's shape is a function of its inputs' shapes alone, and no
    rounding of their values moves it (a dense layer whose TP path truncates its output).
A correct MoE's expert input is made by its block, whose `nonzero` of the router's choice is such an op:
`unknown`, as before. The gate re-derives `by` (diff/recheck.py; the second pass's by diff/recheck_pass.py)."""
from __future__ import annotations

from tpdiag.diff.judge import describe
from tpdiag.records.keys import ROOTS, RecordKey, record_key


def brief(dd) -> dict | None:
    """summary.json's `shape_break` of a degree: the record's key and how many records after it were
    left uncompared - what the records alone give (the gate re-derives it: diff/recheck.py)."""
    brk = dd.shape_break
    if brk is None:
        return None
    after = sum(1 for u in dd.uncompared if u.get("why") == f"past the first record the ranks hold only part of ({brk['key']})")
    return {"key": brk["key"], "not_compared_after": after, "after": brk.get("after"),
            "producer": brk.get("producer"), "by": brk.get("by")}


def producer(dd, brk: dict) -> tuple[str, int] | None:
    """(module, call) of the code that made the break's record: its module's call for a forward output,
    the nearest called ancestor's enclosing call for a forward input; None for any other record, for a
    top-level module's input (the root's code: not re-executed for this) or where no call encloses it."""
    from tpdiag.diff.enclosing import called, enclosing

    k = RecordKey.parse(brk["key"])
    if k.phase != "forward" or k.kind not in ("in", "out") or not isinstance(brk.get("idx"), int):
        return None
    if k.kind == "out":
        return k.module, k.call
    p = enclosing(k.module, called(dd))
    if p is None or p in ROOTS:
        return None
    ins = [r for r in dd.rows if (r["phase"], r["kind"], r["module"], r["step"]) == ("forward", "in", p, k.step)
           and r["idx"] < brk["idx"]]
    if not ins:
        return None
    c = ins[-1]["call"]
    if any((r["phase"], r["kind"], r["module"], r["step"], r["call"]) == ("forward", "out", p, k.step, c)
           for r in dd.rows):
        return None  # that call returned before the record was made: another caller made it
    return p, c


def settle(dd, ref) -> None:
    """Whether a break after a difference is a bug after all (the module docstring): sets the break's
    `producer`, and `by` (the rule) or `unjudged` (why neither rule holds)."""
    from tpdiag.diff.equal_inputs import inputs_equal

    brk = dd.shape_break
    got = producer(dd, brk)
    brk["producer"] = got[0] if got else None
    if brk.get("after") is None:
        return
    if got is None:
        brk["unjudged"] = "no module call made it (a top-level module's input, or no forward output or input)"
        return
    p, c = got
    k = RecordKey.parse(brk["key"])
    mine = [r for r in dd.rows if (r["phase"], r["kind"], r["module"], r["step"], r["call"]) == ("forward", "in", p, k.step, c)]
    first = min((r["idx"] for r in mine), default=brk["idx"])
    if mine and inputs_equal(dd, {"module": p, "step": k.step, "call": c}) and all(
            r["bitwise"] and r.get("rank_consistent") is not False for r in dd.rows if first <= r["idx"] < brk["idx"]):
        brk["by"] = "inputs-equal"
        return
    notes = (getattr(dd, "oracle_notes", None) or {}).get(record_key(k.step, "forward", p, "oracle", c)) or {}
    ran = any(m["kind"] == "oracle" and (m["phase"], m["module"], m["step"], m.get("call")) == ("forward", p, k.step, c)
              and "@" not in m["name"] and not m["name"].startswith(("buffer.", "grad_", "param_grad."))
              for m in ref.events)
    ref_ins = {m["key"] for m in ref.events
               if (m["phase"], m["kind"], m["module"], m["step"], m["call"]) == ("forward", "in", p, k.step, c)}
    if not ran or notes.get("why"):
        brk["unjudged"] = (f"{p}'s code made it; its float64 re-execution in the reference "
                           + (f"was refused ({notes['why']})" if notes.get("why") else "did not run in this pass"))
    elif notes.get("shaped") or notes.get("scalar_args"):
        brk["unjudged"] = (f"{p}'s code made it, and at the reference it ran "
                           + (", ".join(notes["shaped"]) if notes.get("shaped") else "")
                           + (" and " if notes.get("shaped") and notes.get("scalar_args") else "")
                           + ("took a Python number argument" if notes.get("scalar_args") else "")
                           + ": a value may decide its shape")
    elif not ref_ins or not ref_ins <= {r["key"] for r in mine}:
        brk["unjudged"] = f"{p}'s inputs were not all compared here (their shapes are not known to be the reference's)"
    else:
        brk["by"] = "shape-fixed"


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
    if before is not None and brk.get("by") == "inputs-equal":
        why = (f"{why}; a record before it differed already ({before}), but not in the call that made it: "
               f"{brk['producer']}'s inputs and parameters were bitwise the reference's, and every record of "
               "that call before it too - no rounding reached it")
        before = None  # a bug: the rule of a break with nothing before it (judge.py)
    elif before is not None and brk.get("by") == "shape-fixed":
        why = (f"{why}; a record before it differed already ({before}), but the reference's code that made it "
               f"({brk['producer']}, re-executed in float64) let no value decide a shape - no nonzero, mask, "
               ".item() or .tolist(), no Python number argument - and its inputs had the reference's shapes "
               "here: its shape follows from theirs alone, and no rounding changes it")
        before = None
    elif before is not None:
        why = (f"{why}; but a record before it differed already ({before}), and a shape the model computes "
               "from values (an MoE router's top-k deciding an expert's token count, a mask's nonzero, a "
               "capacity) changes with such a difference: the shape alone shows neither a sharding bug nor "
               f"rounding - not judged ({brk.get('unjudged') or 'no producer judged'})")
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
