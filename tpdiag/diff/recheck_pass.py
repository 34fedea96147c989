"""The second pass's float64 verdicts re-derived: each second-pass folder (ops/, region/, region/ops/) is
re-diffed as the compare diffed it (analyse_degree: the layout bounds and the float64 re-executions its
reference world stored), and a record that comes out beyond its bound must be beyond it in that folder's
diff.csv. A bug only the second pass names and that moves its records by less than the not-judged limit
(tiny_term.py:centre_world, a wrong op moving its block's output by a few ULP), its beyond_bound cleared in
ops/diff.csv and its findings cut from both summaries, passed `gate --allow rounding`, exit 0 (red team
hred18): nothing else the gate re-derives tells it from rounding. One-sided: a record diff.csv calls beyond
and the re-diff does not is left to the other checks (a later pass may add findings)."""
from __future__ import annotations

import os

from tpdiag.errors import Inconclusive


def _folders(run_dir: str, summary: dict) -> list[str]:
    from tpdiag.records.paths import SECOND_PASS_DIRS

    sp = summary.get("second_pass") if isinstance(summary, dict) else None
    if not isinstance(sp, dict):
        return []
    name = os.path.basename(str(sp.get("dir") or "").rstrip("/"))
    if name not in SECOND_PASS_DIRS:
        return []  # refused by records/integrity.py
    out = [name]
    if os.path.isdir(os.path.join(run_dir, name, "ops")):
        out.append(os.path.join(name, "ops"))
    return out


def problems(run_dir: str, summary: dict, breaks: dict | None = None) -> dict[str, str]:
    """{label: problem} for the first record of each label a second pass's re-diff finds beyond its bound
    that its diff.csv does not. breaks: filled with {label: shape_break} where a re-diff judged a shape
    break a bug after a difference (diff/shape_break.settle's `by`, from the float64 re-execution of the
    code that made it, which only a second pass holds): the gate's want for that break's finding."""
    from tpdiag.base import files as io
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.paths import DIFF_CSV, SUMMARY
    from tpdiag.records.rundir import read_manifest, read_rows, records_dir, run_file
    from tpdiag.records.store import RecordSet

    out: dict[str, str] = {}
    for sub in _folders(run_dir, summary):
        d = os.path.join(run_dir, sub)
        try:
            manifest = read_manifest(d)
            sub_sum = io.read_json(run_file(run_dir, os.path.join(sub, SUMMARY)))
            rows = read_rows(run_file(run_dir, os.path.join(sub, DIFF_CSV)))
            ref = str(sub_sum.get("reference_label"))
            ref_rs = RecordSet(records_dir(d, manifest, ref))
        except (Inconclusive, OSError, AttributeError):
            continue  # an unreadable pass is records/integrity.py's to report
        for lab in sorted({str(r.get("degree")) for r in rows} - {ref}):
            if lab in out:
                continue
            said = {r["key"] for r in rows if str(r.get("degree")) == lab and r.get("beyond_bound") is True}
            try:
                sub_entry, got = analyse_degree(ref_rs, RecordSet(records_dir(d, manifest, lab)), lab)
            except Inconclusive:
                continue
            brk = sub_entry.get("shape_break")
            if breaks is not None and isinstance(brk, dict) and brk.get("by"):
                breaks.setdefault(lab, brk)
            k = next((r["key"] for r in got if r.get("beyond_bound") is True and r["key"] not in said), None)
            if k is None:
                # a router-flip label the pass gave a record of pass 1's (runner/drill_merge._judged_whole) must
                # be what this pass's records give (diff/flip_check.py): summary.json's, and the pass's own
                from tpdiag.diff import flip_check
                from tpdiag.records.axes import entries

                why = (flip_check.problem(lab, entries(summary).get(lab), got, second=True)
                       or flip_check.problem(lab, entries(sub_sum).get(lab), got))
                if why:
                    out[lab] = f"the second pass in {sub}/: {why}"
                continue
            out[lab] = (f"the second pass in {sub}/: record {k} of TP={lab} is beyond its rounding bound (its "
                        "records re-diffed against the float64 values they stored) but not in its diff.csv "
                        "(edited after the run)")
    return out
