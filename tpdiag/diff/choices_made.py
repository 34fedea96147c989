"""Whether a forward float64 verdict through a module with unclear discrete choices was made on each
side's OWN choices, so that a far verdict there is a wrong result and not a flipped near tie.

A module that makes a top-k / max choice on floating values which rounding could order otherwise (an
MoE router's near tie) is re-executed in float64 from each side's own inputs; where the float64 run
chose otherwise than a run, its value is another function's and a far verdict shows nothing
(oracle_flip; after a router flip, `router-flip`). So a user's MoE whose COMBINE is wrong at TP=2 - each
rank renormalising the gates over the experts it holds - behind a row-parallel projection whose
rounding flipped one token's top-2 read `router-flip`, the run `rounding only`, and a forward-only
`gate --allow rounding` exited 0 (tests/moe_combine_flip.py).

The float64 mode keeps the indices every unclear choice read chose, hashed in the order read
(probes/float64_mode.py: notes `chosen`; `chosen_untold` the choices with no indices - a comparison, a
sort - which this cannot tell). A side's own choices are in its records: the router's integer top-k
output, the experts' integer index input - the module's or a descendant's integer forward records of
the step. Where EVERY unclear choice of the float64 run from the reference's inputs is one of the
reference's such records, bit for bit, and every one of the run from this side's inputs one of this
side's, each float64 run followed its side's choices: both are exact values of what each side's code
computes given the choices it made, flipped tokens included, so the verdict judges the rest of the
module (its combine) on every row - far is a bug, near rounding - and no flip before it explains it.

Not shown by this: that a matching record is the output of the very op it matched (a module with two
choices of one shape whose float64 runs both equal one record); a choice whose indices no record holds
(a top-k inside the module itself, its indices not returned) leaves the verdict as it was (fail closed).
"""
from __future__ import annotations

from tpdiag.records.keys import record_key


def _side_choices(dd, row: dict, side: int) -> set[str]:
    """The hashes of the integer forward records (outputs, and descendants' inputs) of the module and
    its descendants in the record's step, as `side` (0 the reference, 1 this side) holds them whole."""
    from tpdiag.records.hashing import tensor_hash

    m = row["module"]
    got = set()
    for r in dd.rows:
        if r["phase"] != "forward" or r["step"] != row["step"] or r.get("rank_consistent") is False:
            continue
        if r["kind"] not in ("out", "in") or not str(r.get("dtype", "")).startswith(("int", "uint")):
            continue
        if not (r["module"] == m and r["kind"] == "out" or r["module"].startswith(m + ".")):
            continue
        pair = dd.tensors.get(r["key"])
        if pair is not None and pair[side] is not None:
            got.add(tensor_hash(pair[side]))
    return got


def followed(dd, row: dict) -> dict | None:
    """{"ops", "choices"} where a forward output record's float64 re-executions from the
    reference's and from this side's inputs each chose, at every unclear choice, as that side's own
    records show (module doc); None where that is not shown."""
    if row.get("phase") != "forward" or row.get("kind") != "out":
        return None
    key = record_key(row["step"], "forward", row["module"], "oracle", row.get("call") or 0)
    notes = ((getattr(dd, "oracle_notes", None) or {}).get(key),
             (getattr(dd, "oracle_notes_own", None) or {}).get(key))
    n = 0
    for side, note in enumerate(notes):
        if not isinstance(note, dict) or note.get("chosen_untold") or not note.get("chosen"):
            return None
        if not set(note["chosen"]) <= _side_choices(dd, row, side):
            return None
        n = max(n, len(note["chosen"]))
    return {"ops": list(notes[1].get("discrete") or ()), "choices": n}
