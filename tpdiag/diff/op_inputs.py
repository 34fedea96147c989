"""Whether an op record's inputs are known equal to the reference's in its module call: the ops
before it that the reference has no value for, and a rank's own values that the ranks combine
later (diff/oracle.py judges an op against its float64 value only where they are)."""
from __future__ import annotations

from tpdiag.diff import partials


# ops left uncompared whose output differs from, or has no counterpart at, the reference. Not among
# them: an op each rank ran on its own local values ("each rank computed its own part") - with no
# collective after it in the window, the ranks' results never met, so a compared op after it
# that is not TP=1's value within rounding computed another function from the module's equal
# inputs (a partial rotary on the first columns of a rank's flat projection, bf16: only the
# module's output was judged, 3% off where 8 bf16 roundings allow 3.1%, so it read `unknown`)
_UNEQUAL_OPS = ("only at this degree", "collective output before wait_tensor", "unreduced partial sum")


def op_window(rows: list[dict], i: int) -> tuple[int, int]:
    """The ops recorded in the module call whose record (or op) is rows[i] - a module record is
    written after its ops: the index in rows where they start, and the idx of the record before
    them (-1: none)."""
    j = i - 1
    while j >= 0 and rows[j]["kind"] == "op":
        j -= 1
    return j + 1, (rows[j]["idx"] if j >= 0 else -1)


def after_uncompared_op(dd, row: dict) -> bool:
    """An op of this degree that the reference has no value for (a hand-written all-reduce that
    TP=1 skips, a rank's unreduced partial sum) ran in the same module call before `row`: its output may be
    one of row's inputs, so row's inputs are not known to be equal - the reference's float64 value
    of row is no exact answer for this side. (An autocast bf16 row-parallel sum: the all-reduce
    rounds the ranks' bf16 partials, and the float32 residual add after it is then 1 bf16 ULP
    from the reference's - 900x an fp32 rounding, called a bug before.)"""
    i = dd.rows.index(row)
    _, lo = op_window(dd.rows, i)
    hi = next((r["idx"] for r in dd.rows[i + 1:] if r["kind"] != "op"), float("inf"))
    uncompared = getattr(dd, "uncompared", None) or ()
    if any(m.get("kind") == "op" and lo < m["idx"] < row["idx"] and str(m.get("why", "")).startswith(_UNEQUAL_OPS)
           for m in uncompared):
        return True
    # A rank's own part that the ranks' values later meet - in a collective of the module's own
    # code, or in a submodule that reduces it (its input left uncompared as the ranks' shares: a
    # shard's own max, all-reduced MAX, then shifted away - an online softmax over a column-parallel
    # width) - is a per-rank value of another computation than TP=1's, not a column of TP=1's: an
    # op that consumed it holds numbers TP=1 never had, and far from TP=1's float64 value says
    # nothing; the module's own record judges what the call computed (a correct online softmax read
    # BUG at its `h - m`). Where the parts never meet, the rule above stands (_UNEQUAL_OPS).
    own = [m["idx"] for m in uncompared if m.get("kind") == "op" and lo < m["idx"] < row["idx"]
           and str(m.get("why", "")).startswith(_OWN_PART)]
    if not own:
        return False
    ops = [m for m in list(uncompared) + dd.rows if m.get("kind") == "op" and min(own) < m["idx"] < hi]
    if any(str(c.get("name", "")).startswith(_COLLECTIVES) for c in ops):
        return True
    end = next((r["idx"] for r in dd.rows[i + 1:] if r["module"] == row["module"] and r["kind"] == "out"
                and r["step"] == row["step"] and r["phase"] == row["phase"]), float("inf"))
    return any(m.get("kind") == "in" and min(own) < m["idx"] < end
               and str(m.get("why", "")).startswith(("unreduced partial", partials.COMBINED))
               for m in uncompared)


_OWN_PART = "each rank computed its own part"
_COLLECTIVES = ("c10d::", "_c10d_functional::")
