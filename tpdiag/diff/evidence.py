"""Does a finished run directory's evidence agree with itself? The checks `tpdiag report` and
`tpdiag.load` both run before they show anything: records/integrity.py (the verdict files and the
per-rank evidence) and a re-read and re-diff of every record (recheck.verify), so a summary or a
diff.csv edited after the run is inconclusive, never shown as the run's result. The gate runs the
same two with its own per-degree bookkeeping (gate/evidence.py)."""
from __future__ import annotations


def problems(run_dir: str, manifest: dict, summary: dict, rows: list[dict], rerun: bool = False,
             settled: frozenset = frozenset()) -> list[str]:
    """Every disagreement, in words (empty: the run is what its files say). rows: diff.csv's, typed.
    rerun: run_dir is a confirmation's rerun (confirm/FIX/, diff/overrides.py), which runs no second pass;
    settled: its configurations the main run's own verdict already fails (recheck.verify)."""
    from tpdiag.diff.recheck import verify
    from tpdiag.records import integrity
    from tpdiag.records.axes import entries
    from tpdiag.records.rundir import records_dir

    out = integrity.problems(run_dir, manifest, summary, rows, rerun=rerun)
    from tpdiag.diff.classes import class_problems

    out += class_problems(summary)
    degrees = entries(summary)
    ref = str(summary.get("reference_label") or manifest.get("reference") or summary.get("reference"))
    by_label = {lab: sorted((r for r in rows if r["degree"] == lab), key=lambda r: r["idx"] or 0) for lab in degrees}
    ok = [lab for lab in degrees if isinstance(degrees[lab], dict) and degrees[lab].get("status") != "failed"]
    base = summary.get("baseline") if isinstance(summary.get("baseline"), dict) else {}
    base_label = reported_rerun(manifest, base)
    dirs = {lab: records_dir(run_dir, manifest, lab) for lab in [ref, *degrees, *([base_label] if base_label else [])]}
    # every record re-diffed: an edit to diff.csv and summary.json together (a clean table over divergent
    # records, a logprob or loss difference made 0) is inconclusive, not shown
    out += [p if f"TP={lab}" in p or p.startswith("reference") else f"TP={lab}: {p}" for lab, p in
            verify(dirs, ref, ok, by_label, degrees, base_label, bool(base.get("reproducible")),
                                       rerun=rerun, settled=settled).items()]
    from tpdiag.records.rundir import is_diff_dir

    from tpdiag.diff import overrides

    # a bug relabelled rounding stands only on the pass that relabelled it - in a `tpdiag diff` directory
    # too, where no confirmation or second pass can (red team hred21: every finding of
    # user_accum.py --bug accum_tp given `cause_before` under a rounding label passed gate, exit 0)
    out += overrides.problems(run_dir, manifest, summary, problems)  # a confirmation, re-derived from its run
    if not is_diff_dir(run_dir, manifest):
        from tpdiag.diff import oracle_evidence

        out += oracle_evidence.problems(run_dir, summary)  # a float64 verdict's re-execution is on disk
    return out


def reported_rerun(manifest: dict, base: dict) -> str | None:
    """The reference rerun whose records can say whether summary.json's baseline is true: one it
    reports that the manifest ran to the end (a rerun that failed has no records to re-diff)."""
    if base.get("label") is None:
        return None
    w = (manifest.get("worlds") or {}).get(str(base["label"]))
    return str(base["label"]) if base.get("reproducible") or (isinstance(w, dict) and w.get("status") == "ok") else None
