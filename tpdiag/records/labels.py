"""summary.json's rounding labels against the evidence that gave them (red team hred13).

A label is where the gate's verdict comes from: `gate --allow rounding` passes a record labelled
rounding. Two labels were taken at their word:

- `router-flip` (class rounding) is given only after an MoE router picked other experts: an integer
  expert assignment (the router's output, the experts' input) that is not bitwise in diff.csv - which
  the gate re-derives from the records. Written onto a bug's findings with no flip anywhere, it passed
  `gate --allow rounding` (and switched off the check of the findings against the second pass's).
- the second pass judged a record (its float64 re-execution) and the first pass copies that verdict
  (runner/drill.py); a later pass may soften a bug only by keeping the old label as `cause_before`
  (diff/overrides.py checks it). A first divergence the second pass found BUG, relabelled rounding in
  summary.json alone, passed the gate; so did bug findings relabelled `unknown` and written to follow
  the (rounding) first divergence, under which the gate grouped them unjudged.
"""
from __future__ import annotations

ROUTER_NAMES = ("gate", "router")
EXPERTS_NAMES = ("experts",)


def _last(module: str) -> str:
    return str(module).rpartition(".")[2]


def is_router(row: dict) -> bool:
    cls = row.get("cls") or ""
    return _last(row["module"]) in ROUTER_NAMES or cls.endswith(("Router", "TopkRouter", "Gate"))


def is_experts(row: dict) -> bool:
    cls = row.get("cls") or ""
    return _last(row["module"]) in EXPERTS_NAMES or cls.endswith("Experts")


def is_assignment(row: dict) -> bool:
    """An expert-assignment record: the router's integer output or the experts' integer input."""
    if row["phase"] != "forward" or not str(row.get("dtype", "")).startswith(("int", "uint")):
        return False
    return (row["kind"] == "out" and is_router(row)) or (row["kind"] == "in" and is_experts(row))


def flipped(row: dict) -> bool:
    return is_assignment(row) and not row["bitwise"]


def _labelled(d: dict) -> list[tuple[str, dict]]:
    fd = d.get("first_divergence")
    out = [("first divergence", fd)] if isinstance(fd, dict) else []
    return out + [("finding", f) for f in d.get("findings") or () if isinstance(f, dict)]


def flip_problems(degrees: dict, rows: list[dict] | None) -> list[str]:
    """A `router-flip` label stands only where the degree's diff.csv has an expert assignment that
    differs, at or before the labelled record (diff/router.py names the flip there and the findings
    after it)."""
    if rows is None:
        return []
    out = []
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        flips = [r for r in rows if str(r.get("degree")) == lab and flipped(r)]
        for what, f in _labelled(d):
            if f.get("cause") != "router-flip":
                continue
            idx = f.get("idx")
            ok = any(r["step"] == f.get("step") and (not isinstance(idx, int) or r["idx"] <= idx) for r in flips) \
                if isinstance(f.get("step"), int) else bool(flips)
            if not ok:
                out.append(f"summary.json's TP={lab} {what} {f.get('key')} has cause 'router-flip', but diff.csv has "
                           "no expert choice that differs before it (edited after the run)")
                break
    return out


def pass_label_problems(lab: str, d: dict, sd: dict, name: str) -> list[str]:
    """summary.json's TP=lab labels against the second pass's own (sd: that pass's entry for lab): a
    record the pass judged a bug keeps a bug label here, unless a later pass softened it and kept the
    old label (`cause_before`, checked by diff/overrides.py)."""
    from tpdiag.records.causes import cause_class

    judged: dict = {}
    for _, g in _labelled(sd):
        if g.get("key") and cause_class(g.get("cause")) in ("bug", "non-finite"):
            judged.setdefault(g["key"], g.get("cause"))
    for what, f in _labelled(d):
        was = judged.get(f.get("key"))
        # a finding `unknown` too: grouped under the first divergence it would never be judged (gate/findings.grouped);
        # the first divergence may be unknown where the op-level rerun names an op the module pass called a bug
        soft = ("rounding",) if what == "first divergence" else ("rounding", "unknown")
        if was is None or "cause_before" in f or cause_class(f.get("cause")) not in soft:
            continue
        return [f"summary.json's TP={lab} {what} {f.get('key')} has cause {f.get('cause')!r}, but the second pass "
                f"in {name}/ judged it {was!r} (edited after the run)"]
    return []


def unjudged_problems(summary: dict, degrees: dict, rows: list[dict] | None) -> list[str]:
    """A compare's forward first divergence with no layout bound in diff.csv is judged only by the second
    pass's float64 re-execution (runner/drill.py: needs_verdict; compare always runs it there). A rounding
    label on one, with no second pass named in summary.json, stands on nothing: the pass's folders and every
    mention of them deleted, with the label edited, passed `gate --allow rounding` on a BUG run."""
    from tpdiag.records.causes import cause_class

    if rows is None or isinstance(summary.get("second_pass"), dict):
        return []
    by_key = {(str(r.get("degree")), r.get("key")): r for r in rows}
    for lab, d in degrees.items():
        fd = d.get("first_divergence") if isinstance(d, dict) else None
        if not isinstance(fd, dict) or d.get("status") != "divergent":
            continue
        if cause_class(fd.get("cause")) != "rounding" or fd.get("cause") == "router-flip":
            continue
        if d.get("axis") == "attention" and fd.get("cause") == "attention-kernel":
            continue  # named by the configuration alone (diff/judge.py's axis rule): only the attention changed
        r = by_key.get((lab, fd.get("key")))
        # a record of a hash-first capture holds no values in diff.csv (no max abs, no bound), in any phase:
        # only the region pass's values judge it. Its backward first divergence - a BUG's (backward.py:averaged
        # --capture hash) - relabelled rounding, with region/ and every mention of it deleted, passed
        # `gate --allow rounding` (red team hred21): the rule read forward first divergences only
        if r is None or r.get("bound") is not None or (fd.get("phase") != "forward" and r.get("max_abs") is not None):
            continue
        return [f"summary.json's TP={lab} first divergence {fd.get('key')} has no rounding bound in diff.csv, "
                f"so only the second pass's float64 re-execution judges it, yet summary.json names no second "
                f"pass and labels it {fd.get('cause')!r} (edited after the run)"]
    return []


def made_problems(degrees: dict, rows: list[dict] | None) -> list[str]:
    """A finding with a rounding label must be a record diff/locate.py makes a finding - beyond its bound,
    or inconsistent across ranks, in diff.csv (re-derived by the gate) - unless a later pass made it (`from`)
    or relabelled it (`cause_before`); router-flip is flip_problems'. A rounding finding written in on a
    record within its bound gave the gate a root to group the real findings under, relabelled `unknown`:
    a `tpdiag diff` whose loss is a BUG (tests/user_loss_shard.py: entropy_local) passed `gate --allow
    rounding` so (red team hred13)."""
    from tpdiag.records.causes import cause_class

    if rows is None:
        return []
    by_key = {(str(r.get("degree")), r.get("key")): r for r in rows}
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        for f in d.get("findings") or ():
            if not isinstance(f, dict) or cause_class(f.get("cause")) != "rounding" or f.get("cause") == "router-flip" \
                    or "cause_before" in f or "from" in f:
                continue
            r = by_key.get((lab, f.get("key")))
            if r is not None and r.get("beyond_bound") is not True and r.get("rank_consistent") is not False:
                return [f"summary.json's TP={lab} finding {f.get('key')} has cause {f.get('cause')!r}, but diff.csv has "
                        "that record within its bound and consistent across ranks: not a record tpdiag makes a finding "
                        "(edited after the run)"]
    return []
