"""`tpdiag gate`: pass/fail a run directory against a divergence policy, failing closed.

`evaluate(run_dir, policy)` is the library entry (compare can reuse it). It first verifies the
evidence - every degree's records are re-read and re-diffed and must agree with diff.csv and
summary.json - because a gate that trusts an edited or truncated capture can pass a broken model.
Any doubt about the evidence is exit 2, never a pass.
"""
from __future__ import annotations

import os
from dataclasses import replace

from tpdiag.errors import BadInput, Inconclusive
from tpdiag.gate.policy import Policy
from tpdiag.gate.result import DegreeResult, GateResult, Violation


def nonfinite(r: dict) -> bool:
    """NaN or Inf at one side only: compare's max_abs is then infinite (never 0), or NaN in a foreign file."""
    m = r.get("max_abs")
    return m is not None and (m != m or m == float("inf"))


def _judge(lab: str, d: dict, rows: list[dict], policy: Policy) -> DegreeResult:
    from tpdiag.records.causes import cause_class

    fd = d.get("first_divergence") or {}
    root_cause = fd.get("cause") or "unknown"
    every = list(d.get("findings") or [])
    judged = {r["key"] for r in rows}
    found = _by_record(every, judged)
    # the findings a follower may be grouped under: those the gate judges here (a record of diff.csv)
    by_key = {rid[1]: f for rid, f in found.items() if rid[0] == "key"}
    # a finding that follows another (its inputs already carried that one's difference) is grouped
    # under it where _grouped says so, never a violation of its own: counted on that one's violation
    follows = {}
    for f in found.values():
        if "follows" in f and _grouped(f, by_key, fd):
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
        f = _finding(found, r) or {}
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
        if "follows" in f and _grouped(f, by_key, fd):
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
            res.violations.append(Violation(lab, r["phase"], fd.get("module", r["module"]) if root else r["module"],
                                            fd.get("op") if root else None, r["kind"], r["name"], cause,
                                            r["max_ulp"], r["max_abs"], why, r["key"],
                                            beyond=src.get("bound_ratio"),
                                            follow=follows.get(src.get("key") or r["key"], 0),
                                            op_at=(fd.get("op_at") or "") if root else ""))
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


# how grave a finding's class is: where several findings name one record, the gravest judges it
_GRAVITY = {"non-finite": 4, "bug": 3, "unknown": 2, "rounding": 1}


def _gravity(f: dict | None) -> int:
    from tpdiag.records.causes import cause_class

    return 0 if f is None else _GRAVITY.get(cause_class(f.get("cause")), 2)


def _by_record(every: list, judged: set) -> dict:
    """{id: the gravest finding of it}: a finding names its record by its key (step, phase, module, kind,
    call and name), or - one whose key is no diff.csv row's - by (step, phase, module, kind, name) as
    before. The gate once kept the last finding of a (step, phase, module, kind, name) - no call index,
    no key - so a rounding copy appended after a BUG's finding (its key deleted, which integrity's
    checks pass over) judged the BUG's row, `gate --allow rounding` exit 0 (red team hred21), and of a
    module called twice one call's finding could judge the other call's row."""
    out: dict = {}
    for f in every:
        k = f.get("key")
        rid = ("key", k) if k in judged else ("row", f.get("step"), f.get("phase"), f.get("module"), f.get("kind"),
                                             f.get("name"))
        if _gravity(f) > _gravity(out.get(rid)):
            out[rid] = f
    return out


def _finding(found: dict, r: dict) -> dict | None:
    """The gravest finding that judges diff.csv row r (_by_record)."""
    a = found.get(("key", r["key"]))
    b = found.get(("row", r["step"], r["phase"], r["module"], r["kind"], r["name"]))
    return a if _gravity(a) >= _gravity(b) else b


def _moved_unjudged(lab: str, d: dict, rows: list[dict], policy: Policy, res: DegreeResult) -> None:
    """summary.json not_judged (diff/not_judged.py): activation and weight grads past the first divergence that no
    check judged. Said in the verdict, they were never the gate's: tests/models/planted/two_paths.py:
    gate_f (its block's output grad 25% off, float32) passed `gate --allow rounding`, exit 0. Fail
    closed - as cause unknown, which only a policy naming it passes - where they moved more than
    rounding can: not_judged.moved_beyond, the rule compare's class reads too (the dtypes from diff.csv's
    rows here, not the summary's word)."""
    from tpdiag.diff.not_judged import grads_words, moved_beyond

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


def _grouped(f: dict, by_key: dict, fd: dict) -> bool:
    """A finding that follows another is grouped under it - not judged on its own - only where that one
    is a finding (or the first divergence) of this degree that the gate judges (a record of diff.csv, not
    an op only the second pass recorded) and at least as grave (records/causes.groups_under, the rule
    compare's headline groups by: an `unknown` is never grouped under rounding). locate and the second pass group no other way, so a `follows` written into summary.json
    to hide a bug under a rounding difference (or under nothing) is judged as a finding."""
    from tpdiag.records.causes import cause_class, groups_under

    # the first divergence alone (not itself a finding) is followed only by a finding a later pass judged
    # on its own inputs (runner/drill_own.py: cause_before kept) or one the second pass judged (checked against
    # its summary): locate's own followers name a finding. Written into the rest - or into an `unknown` of the
    # second pass, both summaries edited - it hid bugs relabelled `unknown` (red team hred13).
    fd_root = fd.get("key") == f["follows"] and ("cause_before" in f or (
        f.get("from") == "second pass" and cause_class(f.get("cause")) != "unknown"))
    root = by_key.get(f["follows"]) or (fd if fd_root else None)
    if root is None or root is f:
        return False
    return groups_under(f.get("cause"), root.get("cause"))


# What malformed (hand-edited, bit-flipped, foreign) JSON/CSV/records raise deep in the readers and
# the re-diff: the gate turns them into an evidence problem (exit 2), never a crash or a pass.
_MALFORMED = (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError, RuntimeError)


def evaluate(run_dir: str, policy: Policy | None = None) -> GateResult:
    """Never raises on bad evidence: problems land in GateResult.problems (exit 2) so JUnit still gets written."""
    policy = policy or Policy()
    from tpdiag.records.nested import part_of_run

    # a run's own pass (ops/, confirm/<fix>/, auto/round<i>/, variants/<slug>/) is no run to gate
    # alone: its verdict is a part of its run's (records/nested.py); the fix chain's rounds are
    # gated inside their run's evaluation (_judge_chain), never through here
    why = part_of_run(run_dir)
    if why:
        res = GateResult(os.path.abspath(run_dir), policy)
        res.problems.append(why)
        return res
    from tpdiag.gate import once

    try:
        # the re-diffs below read the same pairs again (a confirmation's, a second pass's): measured
        # and hash-checked once in this evaluation (gate/once.py)
        with once.session():
            return _evaluate(run_dir, policy, top=True)
    except Inconclusive as e:
        res = GateResult(os.path.abspath(run_dir), policy)
        res.problems.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        return res
    except _MALFORMED as e:
        res = GateResult(os.path.abspath(run_dir), policy)
        what = str(e).splitlines()[0][:200] if str(e) else ""
        res.problems.append(f"{run_dir}: malformed run directory ({type(e).__name__}: {what}); "
                            "not a complete, unedited tpdiag run")
        return res


def _evaluate(run_dir: str, policy: Policy, top: bool = False) -> GateResult:
    from tpdiag.records.rundir import DIFF_CSV, incomplete, read_manifest, read_rows, read_summary, run_file

    res = GateResult(os.path.abspath(run_dir), policy)
    from tpdiag.records.check import require_run_dir

    try:
        require_run_dir(run_dir)
    except BadInput as e:
        res.problems.append(str(e))
        return res
    try:
        manifest = read_manifest(run_dir)
        why = incomplete(run_dir, manifest)
        if not why and top:
            from tpdiag.records.nested import rerun_pass

            why = rerun_pass(manifest)
        if why:
            res.problems.append(why)
            return res
        summary = read_summary(run_dir)
        from tpdiag.records.axes import entries

        degrees = entries(summary)
        # compare's manifest lists the degrees; a run dir from another writer may only have the summary.
        ref = str(manifest.get("reference") or summary["reference_label"])
        labels = [str(x) for x in manifest.get("labels") or [ref, *degrees]]
    except Inconclusive as e:
        res.problems.append(str(e).splitlines()[0])
        return res
    except (KeyError, TypeError, AttributeError) as e:
        res.problems.append(f"{run_dir}: manifest.json or summary.json lacks {e} (not a complete tpdiag run)")
        return res
    res.reference = ref
    others = [lab for lab in labels if lab != ref]
    if not others:
        res.problems.append("manifest.json lists no degree besides the reference: nothing was compared")
    for lab in sorted(set(degrees) - set(others)):
        res.problems.append(f"summary.json has TP={lab}, which manifest.json does not list")
    from tpdiag.records import integrity

    # The per-rank evidence, the manifest's schema and worlds, and the summary must agree first.
    try:
        rows = read_rows(run_file(run_dir, DIFF_CSV))
        csv_rows = rows
    except Inconclusive as e:
        res.problems.append(str(e).splitlines()[0])
        rows, csv_rows = [], None
    # diff.csv is re-derived from the records below; summary.json's numbers must be diff.csv's.
    res.problems += integrity.problems(run_dir, manifest, summary, csv_rows)
    from tpdiag.diff.classes import class_problems

    res.problems += class_problems(summary)
    from tpdiag.diff import overrides
    from tpdiag.diff.evidence import problems as run_problems
    from tpdiag.records.rundir import is_diff_dir

    # in a `tpdiag diff` directory too: a bug relabelled there with `cause_before` stands on no pass
    res.problems += overrides.problems(run_dir, manifest, summary, run_problems)  # a confirmation, re-derived
    if not is_diff_dir(run_dir, manifest):
        from tpdiag.diff import oracle_evidence

        res.problems += oracle_evidence.problems(run_dir, summary)  # a float64 verdict's re-execution is on disk
    for lab in policy.degrees or ():
        if lab not in others:
            res.problems.append(f"policy gates TP={lab} but the run compared only TP={', '.join(others) or 'none'}")
    by_label = {lab: [r for r in rows if r["degree"] == lab] for lab in others}
    from tpdiag.gate.evidence import degree_errors

    errors = degree_errors(run_dir, manifest, summary, ref, others, by_label)
    for lab in set(errors) - set(others):
        res.problems.append(f"reference rerun TP={lab}: {errors.pop(lab)}")
    for lab in others:
        if lab in errors:
            res.degrees[lab] = DegreeResult(lab, "error", error=errors[lab])
            res.problems.append(f"TP={lab}: {errors[lab]}")
        elif policy.degrees is not None and lab not in policy.degrees:
            res.degrees[lab] = DegreeResult(lab, "skipped")
        else:
            res.degrees[lab] = _judge(lab, degrees[lab], by_label[lab], policy)
            unjudged = (degrees[lab].get("unjudged_capture") or {}).get("why")
            if unjudged and "unknown" not in policy.allow_causes:
                # a capture's first divergence nothing re-executed in float64 (diff/capture_oracle.py):
                # incomplete evidence - a wrong result there reads "not judged", so never a plain fail
                res.problems.append(f"TP={lab}: first divergence not judged: {unjudged}")
    # Normally a failed degree explains an inconclusive summary; with no such degree it stands on its own.
    if summary.get("status") not in ("bitwise", "divergent") and not errors:
        why = summary.get("error") or "no reason given"
        res.problems.append(f"summary.json status is {summary.get('status')}: {why}")
    _judge_chain(res, run_dir, summary.get("fix_chain"), policy)
    res.problems = list(dict.fromkeys(res.problems))  # integrity.problems repeats some of the checks above
    return res


def _judge_chain(res: GateResult, run_dir: str, chain, policy: Policy) -> None:
    """--fix auto: every later round of the chain is gated as its own run, by the same policy.
    A later round is the user's run with reorderings fixed away, so what it finds (a bug that the
    first round's reordering hid, a cause the policy does not allow) is in the user's run too: its
    violations join the degree's, each naming its round; its evidence problems are the gate's."""
    if not chain:
        return
    if not isinstance(chain, list) or not all(isinstance(r, dict) for r in chain):
        res.problems.append(f"{run_dir}: summary.json's fix_chain is not a list of rounds (edited?)")
        return
    for rnd in chain:
        i = rnd.get("round")
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            res.problems.append(f"{run_dir}: summary.json's fix_chain has a round numbered {i!r} (edited?)")
            return
        if i == 0:
            continue
        # where compare wrote it (runner/confirm.auto_chain), beside this run: a moved run directory
        # still finds its rounds
        sub = _evaluate(os.path.join(run_dir, "auto", f"round{i}"), policy)
        res.problems += [f"fix chain round {i}: {p}" for p in sub.problems]
        fixes = tuple(str(f) for f in rnd.get("fixes") or ())
        for lab, d in sub.degrees.items():
            if not d.violations or lab not in res.degrees:
                continue
            mine = res.degrees[lab]
            mine.violations += [replace(v, round=i, fixes=fixes) for v in d.violations]
            mine.status = "fail"
