"""The gate's evidence checks: every degree's records re-read and re-diffed must agree with
diff.csv, and summary.json with both; a degree whose evidence cannot be trusted is an error
(exit 2), never a pass (gate/verdict.py)."""
from __future__ import annotations


def check_summary(lab: str, d: dict, rows: list[dict], judged_break: dict | None = None) -> str | None:
    """judged_break: the shape break a second pass's re-diff judged a bug after a difference
    (diff/recheck_pass.problems' breaks), else None."""
    from tpdiag.records.shares import shares

    # records a full capture read as shares of one value are not compared (records/shares.py)
    left = shares(d)
    div_rows = [r for r in rows if (r["bitwise"] is False or r["rank_consistent"] is False) and r["key"] not in left]
    if d.get("status") == "bitwise" and div_rows:
        return f"summary.json says bitwise but diff.csv has {len(div_rows)} divergent records"
    fd = d.get("first_divergence")
    # locate's rule: the first divergent module record; an op only where no module record differs
    firsts = [r for r in div_rows if r.get("kind") != "op"] or div_rows
    if fd and fd.get("key") and firsts and firsts[0]["key"] != fd["key"]:
        return f"summary.json first divergence {fd['key']} is not the first divergent record {firsts[0]['key']}"
    brk = d.get("shape_break")
    if brk is not None:
        # a record the ranks hold part of (diff/shape_break.py; its key re-derived from the records by
        # diff/recheck.py): its sharding-bug finding must stand - deleted or relabelled, the records' BUG
        # would pass as the rounding of the records before it
        # where a record before it differed already (`after`), an `unknown` one (diff/shape_break.py)
        # - unless the records show no rounding could have made that shape (`by`: re-derived from pass 1's
        # records, or from the second pass's float64 re-execution of the code that made it)
        key = brk.get("key") if isinstance(brk, dict) else None
        judged = isinstance(judged_break, dict) and judged_break.get("key") == key
        want = ("unknown" if isinstance(brk, dict) and brk.get("after") is not None and not brk.get("by")
                and not judged else "sharding-bug")
        # ... flagged as the break (compare always writes the flag: without it the gate once judged it
        # as any finding beside diff.csv's rows, and an `unknown` one passed `--allow rounding`)
        if not any(isinstance(f, dict) and f.get("key") == key and f.get("cause") == want
                   and f.get("shape_break") is True and "follows" not in f for f in d.get("findings") or ()):
            return f"summary.json's shape_break {key} has no {want} finding flagged as the break (edited after the run)"
    for group in d.get("ties_split") or ():
        # a weight tie the plan split (diff/weight_ties.py; the groups re-derived from the captures by
        # diff/recheck.py): its finding must stand, or the grad that lacks the tied uses reads rounding
        names = set(group) if isinstance(group, list) else set()
        if not any(isinstance(f, dict) and f.get("cause") == "sharding-bug" and "follows" not in f
                   and f.get("kind") == "param_grad" and f"{f.get('module')}.{f.get('name')}" in names
                   for f in d.get("findings") or ()):
            return f"summary.json's split weight tie {' = '.join(map(str, group))} has no sharding-bug finding (edited after the run)"
    if d.get("status") == "divergent" and not div_rows and not (d.get("missing") or d.get("unmatched") or brk):
        return "summary.json says divergent but diff.csv has no divergent record"
    return None


def degree_errors(run_dir: str, manifest: dict, summary: dict, ref: str, others: list[str],
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
    from tpdiag.diff.evidence import reported_rerun

    base_label = reported_rerun(manifest, base)
    from tpdiag.records.rundir import records_dir

    dirs = {lab: records_dir(run_dir, manifest, lab) for lab in [ref, *others, *([base_label] if base_label else [])]}
    from tpdiag.diff.recheck import verify

    # every record re-read and re-diffed: diff.csv's rows and summary.json's numbers must be what they give
    errors.update(verify(dirs, ref, [lab for lab in others if lab not in errors], by_label, degrees, base_label,
                         bool(base.get("reproducible"))))
    from tpdiag.diff import recheck_pass

    breaks: dict = {}
    for lab, bad in recheck_pass.problems(run_dir, summary, breaks).items():
        if lab in others:
            errors.setdefault(lab, bad)
    for lab in others:
        if lab not in errors:
            bad = check_summary(lab, degrees[lab], by_label[lab], breaks.get(lab))
            if bad:
                errors[lab] = bad
    return errors
