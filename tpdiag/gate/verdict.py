"""`tpdiag gate`: pass/fail a run directory against a divergence policy, failing closed.

`evaluate(run_dir, policy)` is the library entry (compare can reuse it). It first verifies the
evidence - every degree's records are re-read and re-diffed and must agree with diff.csv and
summary.json - because a gate that trusts an edited or truncated capture can pass a broken model.
Any doubt about the evidence is exit 2, never a pass.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from tpdiag.base.points import config_name
from tpdiag.errors import BadInput, Inconclusive
from tpdiag.gate.policy import Policy


@dataclass
class Violation:
    degree: str
    phase: str
    module: str
    op: str | None
    kind: str
    name: str
    cause: str
    max_ulp: int | None
    max_abs: float | None
    reason: str
    key: str = ""
    beyond: float | None = None  # how far beyond rounding (its bound, or the float64 threshold)
    follow: int = 0              # divergent records that follow from this one (grouped under it)

    @property
    def unit(self) -> str:
        """What diverged, in the run's terms: an op on op-granularity runs, else a module."""
        return "op" if self.op else "module"

    def line(self) -> str:
        ulp = "-" if self.max_ulp is None else str(self.max_ulp)
        mabs = "-" if self.max_abs is None else f"{self.max_abs:.3g}"
        # module-granularity records name no op; an op named is where the difference entered,
        # the numbers are the record's
        op = f" (the difference enters at op {self.op})" if self.op else ""
        far = f"; {self.beyond:.3g}x beyond rounding" if self.beyond and self.beyond > 1 else ""
        more = (f"; and {_count(self.follow, 'record')} that follow from it (not listed)"
                if self.follow else "")
        # the loss phase's records are the loss function's (Target.loss), not a module's
        what = "the loss function" if self.phase == "loss" and self.module == "model" else f"module {self.module}"
        return (f"{config_name(self.degree)}: {what}{op}, phase {self.phase}, record "
                f"{self.kind} {self.name}, cause {self.cause} (max ULP {ulp}, max abs vs the reference "
                f"{mabs}{far}): {self.reason}{more}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class DegreeResult:
    label: str
    status: str            # pass | fail | error | skipped
    checked: int = 0       # divergent records judged against the policy
    violations: list[Violation] = field(default_factory=list)
    error: str | None = None
    ungated: int = 0       # divergent records in phases the policy does not gate


@dataclass
class GateResult:
    run_dir: str
    policy: Policy
    reference: str | None = None
    degrees: dict[str, DegreeResult] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # evidence problems: exit 2

    @property
    def status(self) -> str:
        if self.problems:
            return "inconclusive"
        return "fail" if any(d.violations for d in self.degrees.values()) else "pass"

    @property
    def bug(self) -> bool:
        """A bug-class or non-finite record is beyond policy: exit EXIT_BUG, not 1."""
        from tpdiag.records.causes import cause_class

        return any(cause_class(v.cause) in ("bug", "non-finite") for d in self.degrees.values() for v in d.violations)

    @property
    def exit_code(self) -> int:
        from tpdiag.records.causes import EXIT_BUG

        if self.status == "fail" and self.bug:
            return EXIT_BUG
        return {"pass": 0, "fail": 1, "inconclusive": 2}[self.status]

    @property
    def first_violation(self) -> Violation | None:
        """The headline's: the first bug-class (or non-finite) violation where there is one - not
        a harmless record before it - else the first."""
        from tpdiag.records.causes import cause_class

        every = [v for d in self.degrees.values() for v in d.violations]
        return next((v for v in every if cause_class(v.cause) in ("bug", "non-finite")),
                    every[0] if every else None)

    def lines(self) -> list[str]:
        # Each violation is printed once: the first in the headline, the others under their degree.
        first = self.first_violation
        head = {"pass": "PASS - nothing diverges beyond policy",
                "fail": (f"FAIL - {'a BUG' if self.bug else 'first divergent ' + (first.unit if first else 'record')} "
                         f"beyond policy: {first.line() if first else ''}"),
                "inconclusive": f"INCONCLUSIVE - {self.problems[0] if self.problems else ''}"}[self.status]
        how = ("allow causes or per-module budgets with --policy FILE.toml" if self.policy.source == Policy.source
               else "format")
        out = [f"gate: {head}", f"policy: {self.policy.source} ({how}: docs/ci.md, 'The policy file')"]
        out += [f"warning: {w}" for w in self.policy.warnings]
        out += [f"evidence: {p}" for p in self.problems[1:]]
        for d in self.degrees.values():
            what = {"pass": _pass_words(d),
                    "skipped": "not gated by the policy", "error": f"error: {d.error}",
                    "fail": f"fail ({_count(len(d.violations), 'record')} beyond policy"
                            + ("; the first is in the headline)" if first in d.violations else ")")}[d.status]
            out.append(f"{config_name(d.label)}: {what}")
            out += [f"  {v.line()}" for v in [v for v in d.violations if v is not first][:5]]
        return out

    def to_dict(self) -> dict:
        from tpdiag.base.files import json_safe

        # json_safe: an Inf/NaN max_abs must not become a bare Infinity token in --format json.
        return json_safe({
            "status": self.status, "exit_code": self.exit_code, "run_dir": self.run_dir,
            "reference": self.reference, "policy": asdict(self.policy), "problems": self.problems,
            "first_violation": asdict(self.first_violation) if self.first_violation else None,
            "degrees": {k: asdict(v) for k, v in self.degrees.items()}})


def _pass_words(d: DegreeResult) -> str:
    # "bitwise" only where no record differs at all: a degree whose divergent records sit in phases the
    # policy does not gate passed the policy, it was not bitwise.
    if not d.checked and not d.ungated:
        return "pass (bitwise)"
    parts = [f"{_count(d.checked, 'divergent record')} within policy"] if d.checked else []
    parts += [f"{_count(d.ungated, 'divergent record')} in phases the policy does not gate"] if d.ungated else []
    return f"pass ({'; '.join(parts)})"


def nonfinite(r: dict) -> bool:
    """NaN or Inf at one side only: compare's max_abs is then infinite (never 0), or NaN in a foreign file."""
    m = r.get("max_abs")
    return m is not None and (m != m or m == float("inf"))


def _verify_records(dirs: dict[str, str], ref: str, labels: list[str], csv_rows: dict[str, list[dict]],
                    base: str | None = None) -> dict[str, str]:
    """Re-read every tensor and re-diff it; {label: problem} where the records disagree with diff.csv.

    base: the label of a reference rerun that summary.json calls reproducible; it must still be.
    """
    from tpdiag.diff.engine import diff_degree
    from tpdiag.records.store import RecordSet

    try:
        ref_rs = RecordSet(dirs[ref])
    except Inconclusive as e:
        return {lab: f"reference TP={ref}: {e}" for lab in labels}
    problems = {}
    for lab in labels:
        try:
            dd = diff_degree(ref_rs, RecordSet(dirs[lab]), lab, keep=lambda m: False)
        except Inconclusive as e:
            problems[lab] = str(e).splitlines()[0]
            continue
        want = {r["key"]: r for r in csv_rows.get(lab, [])}
        got = {r["key"]: r for r in dd.rows}
        if set(want) != set(got):
            k = sorted(set(want) ^ set(got))[0]
            problems[lab] = f"records and diff.csv list different records (first {k})"
            continue
        # Floats survive the CSV round trip exactly (repr), so plain equality is the right test. Without
        # per-record hashes an edit that leaves all five metrics unchanged cannot be seen here.
        # The identity fields and rank_consistent too: the policy matches budgets by module/phase and
        # judges rank-inconsistent replicas from these columns, so an edited row must not pass for another.
        metrics = ("bitwise", "max_ulp", "max_abs", "max_rel", "mismatch_fraction", "rank_consistent",
                   "step", "phase", "module", "kind", "call", "name")
        for k, r in got.items():
            if any(r[m] != want[k][m] for m in metrics):
                problems[lab] = f"record {k} does not match diff.csv (records or diff.csv edited after the run)"
                break
    if base:
        try:
            dd = diff_degree(ref_rs, RecordSet(dirs[base]), base, keep=lambda m: False, values=False)
            if dd.missing or dd.unmatched or any(not r["bitwise"] for r in dd.rows):
                problems[base] = "summary.json calls the reference rerun reproducible but its records differ"
        except Inconclusive as e:
            problems[base] = str(e).splitlines()[0]
    return problems


def _check_summary(lab: str, d: dict, rows: list[dict]) -> str | None:
    div_rows = [r for r in rows if r["bitwise"] is False or r["rank_consistent"] is False]
    if d.get("status") == "bitwise" and div_rows:
        return f"summary.json says bitwise but diff.csv has {len(div_rows)} divergent records"
    fd = d.get("first_divergence")
    # locate's rule: the first divergent module record; an op only where no module record differs
    firsts = [r for r in div_rows if r.get("kind") != "op"] or div_rows
    if fd and fd.get("key") and firsts and firsts[0]["key"] != fd["key"]:
        return f"summary.json first divergence {fd['key']} is not the first divergent record {firsts[0]['key']}"
    if d.get("status") == "divergent" and not div_rows and not (d.get("missing") or d.get("unmatched")):
        return "summary.json says divergent but diff.csv has no divergent record"
    return None


def _judge(lab: str, d: dict, rows: list[dict], policy: Policy) -> DegreeResult:
    fd = d.get("first_divergence") or {}
    root_cause = fd.get("cause") or "unknown"
    found = {(f.get("step"), f.get("phase"), f.get("module"), f.get("kind"), f.get("name")): f
             for f in d.get("findings") or []}
    findings = {k: f.get("cause") for k, f in found.items()}
    # a finding that follows another (its inputs already carried that one's difference) is
    # grouped under it, never a violation of its own
    follows = {}
    for f in found.values():
        if "follows" in f:
            follows[f["follows"]] = follows.get(f["follows"], 0) + 1
    res = DegreeResult(lab, "pass")
    first_seen = False
    for r in rows:
        if r["bitwise"] is not False and r["rank_consistent"] is not False:
            continue
        finding = findings.get((r["step"], r["phase"], r["module"], r["kind"], r["name"]))
        if finding == "non-finite" or nonfinite(r):
            # NaN/Inf at one side only is judged in every phase and degree gated: no phase list, budget
            # or allowed cause can pass it (the policy refuses allow_causes = ["non-finite"]).
            res.checked += 1
            first_seen = True
            root = r["key"] == fd.get("key")
            res.violations.append(Violation(lab, r["phase"], fd.get("module", r["module"]) if root else r["module"],
                                            fd.get("op") if root else None, r["kind"], r["name"], "non-finite",
                                            r["max_ulp"], r["max_abs"],
                                            "NaN or Inf at one side only: no budget or cause allows it", r["key"]))
            continue
        if policy.phases is not None and r["phase"] not in policy.phases:
            res.ungated += 1
            continue
        res.checked += 1
        f = found.get((r["step"], r["phase"], r["module"], r["kind"], r["name"])) or {}
        if "follows" in f:
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
            # The summary names the root record's module and op better than the row (an unprobed
            # parent for an input record, the op at op granularity).
            root = r["key"] == fd.get("key")
            src = f or (fd if root else {})
            res.violations.append(Violation(lab, r["phase"], fd.get("module", r["module"]) if root else r["module"],
                                            fd.get("op") if root else None, r["kind"], r["name"], cause,
                                            r["max_ulp"], r["max_abs"], why, r["key"],
                                            beyond=src.get("bound_ratio"),
                                            follow=follows.get(src.get("key") or r["key"], 0)))
    structural = d.get("missing") or d.get("unmatched")
    if structural and not any(r["bitwise"] is False or r["rank_consistent"] is False for r in rows):
        # Divergent only because records exist at one degree and not the other: no cause can allow that.
        k = structural[0]
        res.violations.append(Violation(lab, "-", k, None, "-", "-", "unknown", None, None,
                                        "the degrees recorded different sets of records"))
    res.status = "fail" if res.violations else "pass"
    return res


def _degree_errors(run_dir: str, manifest: dict, summary: dict, ref: str, others: list[str],
                   by_label: dict[str, list[dict]]) -> dict[str, str]:
    """{label: why this degree's evidence cannot be trusted}; the reference's problems spread to all."""
    from tpdiag.records.axes import entries

    degrees = entries(summary)
    worlds = manifest.get("worlds")
    errors: dict[str, str] = {}
    if isinstance(worlds, dict):
        for lab in [ref, *others]:
            w = worlds.get(lab) or {}
            if w.get("status") != "ok":
                status = w.get("status", "missing from manifest.json")
                errors[lab] = f"world {status}: {w.get('error') or 'no error recorded'}"
    if ref in errors:
        return {lab: f"reference TP={ref} {errors[ref]}" for lab in others}
    for lab in others:
        if lab in errors:
            continue
        if lab not in degrees:
            errors[lab] = "listed in manifest.json, absent from summary.json"
        elif degrees[lab].get("status") == "failed":
            errors[lab] = f"failed: {degrees[lab].get('error')}"
    base = summary.get("baseline") or {}
    base_label = str(base["label"]) if base.get("reproducible") and base.get("label") else None
    from tpdiag.records.rundir import records_dir

    dirs = {lab: records_dir(run_dir, manifest, lab) for lab in [ref, *others, *([base_label] if base_label else [])]}
    errors.update(_verify_records(dirs, ref, [lab for lab in others if lab not in errors], by_label, base_label))
    for lab in others:
        if lab not in errors:
            bad = _check_summary(lab, degrees[lab], by_label[lab])
            if bad:
                errors[lab] = bad
    return errors


# What malformed (hand-edited, bit-flipped, foreign) JSON/CSV/records raise deep in the readers and
# the re-diff: the gate turns them into an evidence problem (exit 2), never a crash or a pass.
_MALFORMED = (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError, RuntimeError)


def evaluate(run_dir: str, policy: Policy | None = None) -> GateResult:
    """Never raises on bad evidence: problems land in GateResult.problems (exit 2) so JUnit still gets written."""
    policy = policy or Policy()
    try:
        return _evaluate(run_dir, policy)
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


def _evaluate(run_dir: str, policy: Policy) -> GateResult:
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
    for lab in policy.degrees or ():
        if lab not in others:
            res.problems.append(f"policy gates TP={lab} but the run compared only TP={', '.join(others) or 'none'}")
    by_label = {lab: [r for r in rows if r["degree"] == lab] for lab in others}
    errors = _degree_errors(run_dir, manifest, summary, ref, others, by_label)
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
    # Normally a failed degree explains an inconclusive summary; with no such degree it stands on its own.
    if summary.get("status") not in ("bitwise", "divergent") and not errors:
        why = summary.get("error") or "no reason given"
        res.problems.append(f"summary.json status is {summary.get('status')}: {why}")
    return res
