"""The gate's verdict on one degree of a run: every divergent diff.csv row, the findings of records
pass 1 did not hold, the grads past the first divergence no check judged, per-rank blocks that run
another model, and records one degree holds and the other does not - each a Violation or a pass.
gate/verdict.py verifies the evidence first and calls judge_degree per degree it gates."""
from __future__ import annotations

from tpdiag.gate.findings import by_record, gravest, grouped
from tpdiag.gate.policy import Policy
from tpdiag.gate.result import DegreeResult, Violation


def nonfinite(r: dict) -> bool:
    """NaN or Inf at one side only: compare's max_abs is then infinite (never 0), or NaN in a foreign file."""
    m = r.get("max_abs")
    return m is not None and (m != m or m == float("inf"))


def judge_degree(lab: str, d: dict, rows: list[dict], policy: Policy) -> DegreeResult:
    from tpdiag.records.causes import cause_class

    fd = d.get("first_divergence") or {}
    root_cause = fd.get("cause") or "unknown"
    every = list(d.get("findings") or [])
    judged = {r["key"] for r in rows}
    found = by_record(every, judged)
    # the findings a follower may be grouped under: those the gate judges here (a record of diff.csv)
    by_key = {rid[1]: f for rid, f in found.items() if rid[0] == "key"}
    # a finding that follows another (its inputs already carried that one's difference) is grouped
    # under it where grouped says so, never a violation of its own: counted on that one's violation
    follows = {}
    for f in found.values():
        if "follows" in f and grouped(f, by_key, fd):
            follows[f["follows"]] = follows.get(f["follows"], 0) + 1
    from tpdiag.records.shares import shares

    # read whole by the region pass as shares of one value: not compared (records/shares.py; the
    # integrity checks hold the list to that pass's own)
    left = shares(d)
    res = DegreeResult(lab, "pass")
    first_seen = False
    for r in rows:
        if (r["bitwise"] is not False and r["rank_consistent"] is not False) or r["key"] in left:
            continue
        f = gravest(found, r) or {}
        finding = f.get("cause")
        if finding == "non-finite" or nonfinite(r):
            # NaN/Inf at one side only is judged in every phase and degree gated: no phase list, budget
            # or allowed cause can pass it (the policy refuses allow_causes = ["non-finite"]).
            res.checked += 1
            first_seen = True
            root = r["key"] == fd.get("key")
            res.violations.append(Violation(lab, r["phase"], fd.get("module", r["module"]) if root else r["module"],
                                            fd.get("op") if root else None, r["kind"], r["name"], "non-finite",
                                            r["max_ulp"], r["max_abs"],
                                            "NaN or Inf (at one side or both): no budget or cause allows it", r["key"]))
            continue
        if policy.phases is not None and r["phase"] not in policy.phases and cause_class(finding) != "bug":
            # a bug-class finding (a wrong result, a replica whose ranks disagree) is judged in every phase,
            # as a NaN is: a phase list is for budgeting rounding, and a bug in a backward the policy
            # leaves out is still in the model (only allow_causes can let it through, by name)
            res.ungated += 1
            continue
        res.checked += 1
        if "follows" in f and grouped(f, by_key, fd):
            continue
        cause = finding or root_cause
        is_first, first_seen = not first_seen, True
        budget = policy.budget_for(r)
        # The first divergent record and every finding are judged by cause or budget; later records only
        # inherit the first one's difference, so only an explicit budget judges them.
        if finding:
            ok = cause in policy.allow_causes and (budget is None or budget.within(r))
            why = (f"finding beyond bound; {budget.describe()} exceeded" if budget and cause in policy.allow_causes
                   else "finding (beyond its rounding bound or rank-inconsistent) and cause not in allow_causes")
        elif budget is not None:
            ok, why = budget.within(r), f"{budget.describe()} exceeded"
        elif is_first:
            ok, why = cause in policy.allow_causes, "cause not in allow_causes and no budget covers this module"
        else:
            ok, why = True, ""
        if not ok:
            if str(f.get("from", "")).startswith("confirmation ("):
                # compare's text says this finding is the confirmation rerun's; the gate named it as
                # this run's first, ahead of the BUG compare names (an input, before its module's output)
                why += "; found in the " + f["from"].replace("confirmation", "confirmation rerun", 1) + \
                    (f", computed in {f['made_in']}'s own forward code" if f.get("kind") == "in" and f.get("made_in") else "")
            # The summary names the root record's module and op better than the row (an unprobed
            # parent for an input record, the op at op granularity).
            root = r["key"] == fd.get("key")
            src = f or (fd if root else {})
            # a far caller's bug: the op where its code goes wrong, past a reordering that differs first
            bug = fd.get("bug_op") if root and fd.get("cause") == "sharding-bug" and \
                isinstance(fd.get("bug_op"), dict) else None
            op, op_at = (bug.get("op"), bug.get("at")) if bug else (fd.get("op"), fd.get("op_at"))
            res.violations.append(Violation(lab, r["phase"], fd.get("module", r["module"]) if root else r["module"],
                                            op if root else None, r["kind"], r["name"], cause,
                                            r["max_ulp"], r["max_abs"], why, r["key"],
                                            beyond=bug.get("caller_ratio") if bug else src.get("bound_ratio"),
                                            follow=follows.get(src.get("key") or r["key"], 0),
                                            op_at=(op_at or "") if root else ""))
    brk = d.get("shape_break")
    _beside_rows(lab, every, judged, fd, policy, res, brk.get("key") if isinstance(brk, dict) else None)
    if d.get("downstream_unjudged") and "unknown" not in policy.allow_causes and not res.violations:
        # compare called this degree unjudged (class unknown, never "rounding only"): the modules past the
        # first divergence that were to be judged on their own inputs were not, so a bug may sit there
        # unseen. Only a policy that allows `unknown` by name passes it.
        res.violations.append(Violation(lab, fd.get("phase", "-"), fd.get("module", "-"), None, fd.get("kind", "-"),
                                        fd.get("name", "-"), "unknown", fd.get("max_ulp"), fd.get("max_abs"),
                                        f"not judged: {d['downstream_unjudged']} (cause unknown is not in allow_causes)",
                                        fd.get("key", "")))
    _moved_unjudged(lab, d, rows, policy, res)
    for block, e in (d.get("per_rank") or {}).items():
        # a per-rank block (runner/per_rank.py) whose left-out weights are none of the reference's:
        # the degree runs another model whatever the block's output reads - bitwise included, where
        # no row above is a violation - so it is judged here, as a bug only allow_causes can pass
        why = e.get("not_the_reference") if isinstance(e, dict) else None
        if why and "rank-inconsistent-replica" not in policy.allow_causes and not any(
                v.module == block and v.cause == "rank-inconsistent-replica" for v in res.violations):
            res.violations.append(Violation(lab, "forward", str(block), None, "out", "-", "rank-inconsistent-replica",
                                            None, None, str(why)))
    structural = d.get("missing") or d.get("unmatched")
    if structural and not any(r["bitwise"] is False or r["rank_consistent"] is False for r in rows):
        # Divergent only because records exist at one degree and not the other: no cause can allow that.
        k = structural[0]
        res.violations.append(Violation(lab, "-", k, None, "-", "-", "unknown", None, None,
                                        "the degrees recorded different sets of records"))
    res.status = "fail" if res.violations else "pass"
    return res



def _moved_unjudged(lab: str, d: dict, rows: list[dict], policy: Policy, res: DegreeResult) -> None:
    """summary.json not_judged (diff/not_judged.py): activation and weight grads past the first divergence that no
    check judged. Said in the verdict, they were never the gate's: tests/models/planted/two_paths.py:
    gate_f (its block's output grad 25% off, float32) passed `gate --allow rounding`, exit 0. Fail
    closed - as cause unknown, which only a policy naming it passes - where they moved more than
    rounding can: diff/moved_limit.moved_beyond, the rule compare's class reads too (the dtypes from diff.csv's
    rows here, not the summary's word)."""
    from tpdiag.diff.moved_limit import moved_beyond
    from tpdiag.diff.not_judged_words import grads_words

    nj = d.get("not_judged")
    if "unknown" in policy.allow_causes or not isinstance(nj, dict):
        return
    keys = [k for k in nj.get("keys") or () if isinstance(k, str)]
    # no listed record in diff.csv says its dtype (not a compare's writing): bfloat16's, passing as before
    got = moved_beyond(d, [r.get("dtype") for r in rows if r["key"] in keys] or ["bfloat16"])
    if got is None:
        return
    moved, limit = got
    key = keys[0] if keys else ""
    from tpdiag.records.keys import MalformedKey, RecordKey

    # the first listed record as it is: a weight's grad (param_grad NAME) was named "record grad_out -"
    try:
        k = RecordKey.parse(key)
        module, kind, name = k.module, k.kind, k.name if k.name is not None else "-"
    except MalformedKey:  # an edited summary: the violation stands, its module unnamed
        module, kind, name = "-", "grad_out", "-"
    res.violations.append(Violation(lab, "backward", module, None, kind, name, "unknown", None, None,
                                    f"{grads_words(nj)} past the first divergence "
                                    f"not judged (summary.json not_judged), moved up to {moved:.3g} of the "
                                    f"reference's norm - beyond rounding's {limit:.3g} (cause unknown is not in "
                                    "allow_causes)", key))


def _beside_rows(lab: str, found: list, judged: set, fd: dict, policy: Policy, res: DegreeResult,
                 brk_key: str | None = None) -> None:
    """The bug-class findings of records pass 1's diff.csv does not hold (an op only the op-level
    second pass recorded; integrity.py holds each to that pass's summary): the headline's class counts
    them, so the gate judges them too. A wrong op whose module's output moved within rounding
    (tests/models/planted/tiny_term.py:centre_world) read BUG while the gate judged the first
    divergence's rounding label alone and exited 1. Grouped only under one at least as grave
    (records/causes.groups_under). brk_key: summary.json's shape_break key (re-derived from the records
    by diff/recheck.py): its finding is the break's whatever its own `shape_break` flag says - a flag
    deleted from summary.json once let moe_expert_calls.py:calls_split's `unknown` pass `--allow rounding`."""
    from tpdiag.records.causes import cause_class, groups_under

    every = {f.get("key"): f for f in found if f.get("key")}
    for f in found:
        grave = cause_class(f.get("cause"))
        if f.get("key") in judged:
            continue
        is_break = bool(f.get("shape_break")) or (brk_key is not None and f.get("key") == brk_key)
        if is_break and grave == "unknown":
            # a record the ranks hold part of after a difference (diff/shape_break.py): no diff.csv row
            # holds it and every record after it is uncompared, so only a policy naming `unknown` passes it
            if "unknown" not in policy.allow_causes:
                res.checked += 1
                res.violations.append(Violation(lab, f.get("phase", "-"), f.get("module", "-"), None, f.get("kind", "-"),
                                                f.get("name", "-"), "unknown", None, None,
                                                "the ranks hold only part of the reference's record after a record "
                                                "that differed (a shape computed from values may follow rounding): "
                                                "not judged, every record after it not compared (cause unknown is "
                                                "not in allow_causes)", f.get("key", "")))
            continue
        if grave not in ("bug", "non-finite"):
            continue
        root = every.get(f.get("follows")) or (fd if "follows" in f and fd.get("key") == f["follows"] else None)
        if root is not None and root is not f and groups_under(f.get("cause"), root.get("cause")):
            continue
        if grave == "bug" and f.get("cause") in policy.allow_causes:
            continue
        op = str(f.get("name") or "").rsplit("#", 1)[0] if f.get("kind") == "op" else f.get("op")
        res.checked += 1
        res.violations.append(Violation(lab, f.get("phase", "-"), f.get("module", "-"), op, f.get("kind", "-"),
                                        f.get("name", "-"), f.get("cause") or "unknown", None, f.get("max_abs"),
                                        ("the ranks hold only part of the reference's record (no layout gathers "
                                         "it) and cause not in allow_causes" if is_break else
                                         "finding of the second pass (a record pass 1 did not hold) and cause not "
                                         "in allow_causes") if grave == "bug" else
                                        "NaN or Inf (at one side or both): no budget or cause allows it",
                                        f.get("key", ""), beyond=f.get("bound_ratio")))

