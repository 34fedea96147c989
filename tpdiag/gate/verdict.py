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
from tpdiag.gate.degree import judge_degree
from tpdiag.gate.policy import Policy
from tpdiag.gate.result import DegreeResult, GateResult

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

            why = rerun_pass(manifest, run_dir)
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
            res.degrees[lab] = judge_degree(lab, degrees[lab], by_label[lab], policy)
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
