"""Whether a buffer whose replicas differ across the ranks is read (diff/judge.py's rules read
row["replica_read"]). A per-rank statistic kept for the logs (each rank's own experts' token counts)
differs across the ranks by design and no forward reads it: called `rank-inconsistent-replica`, a BUG,
it named no wrong result of the model's numerics. A replica the next step reads (a load-balancing bias
nudged from each rank's own counts) is one. What the records show, at the buffer's owner module (or the nearest module above it called at
the next step: a holder of state never called itself is read by the module around it):

  read     a later step's forward output of the owner is rank-inconsistent although its inputs were
           not, or differs from the reference although its inputs were bitwise equal; or that step's
           first record whose ranks differ is a module's forward output, its inputs and parameters
           the same on every rank (a reader beside the owner). Every step until the buffer is
           written again is asked, not the next alone
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
    first_split: dict = {}  # step -> its first forward record whose ranks differ
    for r in rows:
        if r["phase"] == "forward" and r["kind"] in ("in", "out"):
            fwd.setdefault((r["step"], r["module"], r["kind"]), []).append(r)
            if r.get("rank_consistent") is False:
                first_split.setdefault(r["step"], r)
        elif r["phase"] == "backward" and r["kind"] in ("grad_out", "param_grad") \
                and (not r["bitwise"] or r.get("rank_consistent") is False):
            moved.setdefault(r["step"], r)
    split_params = {(r["step"], r["module"]) for r in rows
                    if r["kind"] in ("param", "param_init") and r.get("rank_consistent") is False}
    writes: dict = {}  # (module, name) -> the steps that wrote it
    for r in rows:
        if r["kind"] == "buffer":
            writes.setdefault((r["module"], r["name"]), set()).add(r["step"])
    unread: set = set()
    varied: dict = {}  # (module, name) -> the module that varies per rank by itself, beside it (_varies)
    for r in sorted(wrote, key=lambda r: r["step"]):
        m, s, name = r["module"], r["step"], r["name"]
        what = f"buffer {name} of {m}"
        if s == last:
            if (m, name) in varied and (m, name) not in unread:
                r["replica_read"] = {"read": None, "varies": True, "why": (
                    f"{what} differs across ranks, and no later step is recorded to show whether anything reads "
                    f"it; at the earlier steps the only sign of a reader was {varied[(m, name)]}, whose ranks "
                    "differed on the same inputs before this buffer did (a kernel whose result varies per rank)")}
            elif (m, name) in unread:
                r["replica_read"] = {"read": False, "why": (
                    f"{what} differs across ranks; not read by any recorded step: at the earlier steps its value "
                    f"did not change {m}'s forward either (bitwise the reference's on every rank)")}
            else:
                r["replica_read"] = {"read": None, "why": (
                    f"{what} differs across ranks, and no later step is recorded to show whether anything reads "
                    "it (run one step more: a per-rank statistic nobody reads is no wrong result)")}
            continue
        # the steps that may read this value: each until the buffer is written again (that step's
        # forward may still read it first), or the last recorded. A value first read two steps on
        # (quantisation after a warm-up: tests/models/planted/replica_later.py:after_warmup) was
        # called unread from the next step alone
        again = min((t for t in writes.get((m, name), ()) if t > s), default=last)
        got = None
        # the first step after which this buffer's replicas differed: a module whose ranks differed by
        # that step, on the same inputs, did so without its value (diff/replicas._varies)
        since = min(w["step"] for w in wrote if (w["module"], w["name"]) == (m, name))
        for t in range(s + 1, again + 1):
            got = _at_step(r, t, fwd, moved, first_split, split_params, since)
            if got["read"] is not False:
                break
        if got.get("varies"):
            varied[(m, name)] = got["module"]
        if got["read"] is False:
            unread.add((m, name))
            if again > s + 1:
                got["why"] += f" (and so are steps {s + 2}-{again})" if again > s + 2 else f" (and so is step {again})"
        r["replica_read"] = got


def _varies(module: str, since: int, fwd: dict) -> int | None:
    """The first step up to `since` at which `module`'s forward output already differed across the
    ranks although its inputs did not: before the buffer's replicas differed, so not by reading it -
    a kernel whose result varies per rank (a nondeterministic GPU kernel: atomics), or state of its
    own. None where no such step is recorded."""
    for u in range(since + 1):
        outs, ins = fwd.get((u, module, "out"), []), fwd.get((u, module, "in"), [])
        if any(o.get("rank_consistent") is False for o in outs) and all(i.get("rank_consistent") is not False for i in ins):
            return u
    return None


def _at_step(r: dict, t: int, fwd: dict, moved: dict, first_split: dict, split_params: set,
             since: int | None = None) -> dict:
    """Whether step t reads buffer r's value (the module doc): read True, False (unread there) or
    None (not shown), and why."""
    m, name = r["module"], r["name"]
    what = f"buffer {name} of {m}"
    # who may read it: its owner, or any module above it (a holder of state that is never called
    # itself, `moe.balance`, is read by the `moe` that holds it). The nearest one called at the
    # step is judged; "unread" needs every one called there bitwise on every rank
    # (tests/models/planted/stats_elsewhere.py: `moe.balance` "not called again" read unknown)
    chain = [m] + [m.rsplit(".", i)[0] for i in range(1, m.count(".") + 1)] + (["model"] if m != "model" else [])
    called = [x for x in chain if fwd.get((t, x, "out"))]
    near = called[0] if called else m
    outs, ins = fwd.get((t, near, "out"), []), fwd.get((t, near, "in"), [])
    above = [o for x in called[1:] for o in fwd[(t, x, "out")]]
    ins_equal = all(i["bitwise"] and i.get("rank_consistent") is not False for i in ins)
    ins_consistent = all(i.get("rank_consistent") is not False for i in ins)
    forward_clean = all(o["bitwise"] and o.get("rank_consistent") is not False for o in outs + above)
    if any(o.get("rank_consistent") is False for o in outs) and ins_consistent:
        return {"read": True, "why": (
            f"{what} differs across ranks and step {t} reads it: {near}'s forward output there differs "
            "across ranks, its inputs not")}
    if any(not o["bitwise"] for o in outs) and ins_equal:
        return {"read": True, "why": (
            f"{what} differs across ranks and step {t} reads it: {near}'s forward output there differs, "
            "its inputs bitwise equal")}
    split = first_split.get(t)
    if split is not None and split["kind"] == "out" \
            and not any(k[1] == split["module"] or k[1].startswith(split["module"] + ".")
                        for k in split_params if k[0] in (t - 1, t)):
        # a module beside the owner that reads it (a quantiser given the observer, not above it):
        # the step's first record whose ranks differ is that module's output, its inputs and
        # parameters the same on every rank - per-rank state read there; the owner's own output
        # never changes (replica_later.py:beside read "not shown", by luck not "unread")
        u = _varies(split["module"], r["step"] if since is None else since, fwd)
        if u is not None:
            # ... unless that module's ranks differed on equal inputs already, before this buffer's
            # did: then its split at step t shows nothing about this buffer (a nondeterministic kernel
            # made every unread per-rank buffer a BUG: tests/models/planted/varies_rank.py)
            return {"read": None, "varies": True, "module": split["module"], "why": (
                f"{what} differs across ranks; whether step {t} reads it is not shown: {split['module']}'s forward "
                f"output there is the step's first record that differs across ranks, but it differed across ranks "
                f"on the same inputs at step {u} already, before this buffer did - a kernel whose result varies "
                "per rank (nondeterministic), not evidence that it reads this buffer")}
        return {"read": True, "why": (
            f"{what} differs across ranks and step {t} reads per-rank state: {split['module']}'s forward "
            "output there is the step's first record that differs across ranks, its inputs and parameters "
            f"the same on every rank (this buffer, or other state that differs across ranks, read there)")}
    if forward_clean and t not in moved:
        return {"read": False, "why": (
            f"{what} differs across ranks; not read by any recorded step: {near}'s forward at step {t} "
            "is bitwise the reference's on every rank"
            + (f", and so is every module above it ({', '.join(called[1:])})" if above else "")
            if outs else f"{what} differs across ranks; not read by any recorded step: neither {m} nor any "
            "module above it is called again")}
    if forward_clean:  # and a grad of step t moved
        # a buffer read in the backward only (a custom autograd function's saved state) leaves
        # every forward bitwise: a grad of the step that is not the reference's may be its doing
        return {"read": None, "why": (
            f"{what} differs across ranks; whether step {t} reads it is not shown: its forward is "
            f"bitwise, but its backward is not ({moved[t]['key']}) - a buffer read in the backward")}
    return {"read": None, "why": (
        f"{what} differs across ranks; whether step {t} reads it is not shown ({near}'s inputs "
        "there differ too, or a module above it differs)")}
