"""Whether a buffer whose replicas differ across the ranks is read (diff/judge.py's rules read
row["replica_read"]). A per-rank statistic kept for the logs (each rank's own experts' token counts)
differs across the ranks by design and no forward reads it: called `rank-inconsistent-replica`, a BUG,
it named no wrong result of the model's numerics. A replica the next step reads (a load-balancing bias
nudged from each rank's own counts) is one. What the records show, at the buffer's owner module (or the nearest module above it called at
the next step: a holder of state never called itself is read by the module around it):

  read     a later step's forward output of the owner is rank-inconsistent although its inputs were
           not, or differs from the reference although its inputs were bitwise equal
  unread   the next recorded step's forward outputs of the owner (and of every module above it) are
           bitwise the reference's on every rank (or none is called again), and so is every grad of
           that step's backward (a buffer read in the backward only leaves the forward bitwise); at the
           last recorded step, the same buffer was shown unread at an earlier step
  not shown otherwise (no later step recorded, or its inputs there differ too): the BUG stays,
           saying so (fail closed)
"""
from __future__ import annotations


def mark(dd) -> None:
    rows = dd.rows
    wrote = [r for r in rows if r["kind"] == "buffer" and r.get("rank_consistent") is False]
    if not wrote:
        return
    last = max(r["step"] for r in rows)
    fwd: dict = {}
    moved: dict = {}  # step -> a backward grad there that is not the reference's bitwise on every rank
    for r in rows:
        if r["phase"] == "forward" and r["kind"] in ("in", "out"):
            fwd.setdefault((r["step"], r["module"], r["kind"]), []).append(r)
        elif r["phase"] == "backward" and r["kind"] in ("grad_out", "param_grad") \
                and (not r["bitwise"] or r.get("rank_consistent") is False):
            moved.setdefault(r["step"], r)
    unread: set = set()
    for r in sorted(wrote, key=lambda r: r["step"]):
        m, s, name = r["module"], r["step"], r["name"]
        what = f"buffer {name} of {m}"
        if s == last:
            if (m, name) in unread:
                r["replica_read"] = {"read": False, "why": (
                    f"{what} differs across ranks; not read by any recorded step: at the earlier steps its value "
                    f"did not change {m}'s forward either (bitwise the reference's on every rank)")}
            else:
                r["replica_read"] = {"read": None, "why": (
                    f"{what} differs across ranks, and no later step is recorded to show whether anything reads "
                    "it (run one step more: a per-rank statistic nobody reads is no wrong result)")}
            continue
        # who may read it: its owner, or any module above it (a holder of state that is never called
        # itself, `moe.balance`, is read by the `moe` that holds it). The nearest one called at the
        # next step is judged; "unread" needs every one called there bitwise on every rank
        # (tests/models/planted/stats_elsewhere.py: `moe.balance` "not called again" read unknown)
        chain = [m] + [m.rsplit(".", i)[0] for i in range(1, m.count(".") + 1)] + (["model"] if m != "model" else [])
        called = [x for x in chain if fwd.get((s + 1, x, "out"))]
        near = called[0] if called else m
        outs, ins = fwd.get((s + 1, near, "out"), []), fwd.get((s + 1, near, "in"), [])
        above = [o for x in called[1:] for o in fwd[(s + 1, x, "out")]]
        ins_equal = all(i["bitwise"] and i.get("rank_consistent") is not False for i in ins)
        ins_consistent = all(i.get("rank_consistent") is not False for i in ins)
        forward_clean = all(o["bitwise"] and o.get("rank_consistent") is not False for o in outs + above)
        if any(o.get("rank_consistent") is False for o in outs) and ins_consistent:
            r["replica_read"] = {"read": True, "why": (
                f"{what} differs across ranks and step {s + 1} reads it: {near}'s forward output there differs "
                "across ranks, its inputs not")}
        elif any(not o["bitwise"] for o in outs) and ins_equal:
            r["replica_read"] = {"read": True, "why": (
                f"{what} differs across ranks and step {s + 1} reads it: {near}'s forward output there differs, "
                "its inputs bitwise equal")}
        elif forward_clean and (s + 1) not in moved:
            unread.add((m, name))
            r["replica_read"] = {"read": False, "why": (
                f"{what} differs across ranks; not read by any recorded step: {near}'s forward at step {s + 1} "
                "is bitwise the reference's on every rank"
                + (f", and so is every module above it ({', '.join(called[1:])})" if above else "")
                if outs else f"{what} differs across ranks; not read by any recorded step: neither {m} nor any "
                "module above it is called again")}
        elif forward_clean:  # and a grad of step s + 1 moved
            # a buffer read in the backward only (a custom autograd function's saved state) leaves
            # every forward bitwise: a grad of the step that is not the reference's may be its doing
            r["replica_read"] = {"read": None, "why": (
                f"{what} differs across ranks; whether step {s + 1} reads it is not shown: its forward is "
                f"bitwise, but its backward is not ({moved[s + 1]['key']}) - a buffer read in the backward")}
        else:
            r["replica_read"] = {"read": None, "why": (
                f"{what} differs across ranks; whether step {s + 1} reads it is not shown ({near}'s inputs "
                "there differ too, or a module above it differs)")}
