"""Does a compare's run directory agree with itself? The per-rank evidence (completion and error
markers, each world's result.json), manifest.json (its schema, its worlds) and summary.json must
tell one story. The gate and the report read this before any verdict: a summary that says
"bitwise" or "reproducible" over evidence that says otherwise is inconclusive, never a pass.

Only file reads here (records/ is the contract layer): the re-diff of the tensors is the gate's.
"""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.base.configs import folder
from tpdiag.errors import Inconclusive
from tpdiag.records.paths import RESULT, rank_marker, world_file

SCHEMA = 1
STATUSES = ("bitwise", "divergent", "inconclusive")


def schema_ok(v) -> bool:
    # `true == 1` in Python: a schema must be the integer itself, not a bool or a float.
    return type(v) is int and v == SCHEMA


def _world_problem(run_dir: str, manifest: dict, label: str, degree, base: str | None = None) -> str | None:
    """Why the records of a world the manifest calls ok cannot be trusted, or None."""
    from tpdiag.records.rundir import records_dir

    who = f"reference rerun TP={label}" if label == base else f"TP={label}"
    try:
        d = records_dir(run_dir, manifest, label)
    except Inconclusive as e:
        return f"{who}: {e}"
    try:
        res = io.read_json(world_file(d, RESULT))
    except Inconclusive as e:
        return f"{who}: {str(e).splitlines()[0]}"
    if not isinstance(res, dict) or res.get("status") != "ok":
        status = res.get("status") if isinstance(res, dict) else res
        return f"{who}: {folder(label)}/{RESULT} says {status!r} but manifest.json says ok"
    if str(res.get("label")) != label or res.get("degree") != degree:
        return f"{who}: {folder(label)}/{RESULT} is for TP={res.get('label')} (degree {res.get('degree')!r})"
    if type(degree) is not int or not 1 <= degree <= 1 << 16:
        return f"{who}: manifest.json degree {degree!r} is not a world size"
    try:
        errors = sorted(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(".error"))
    except OSError as e:
        return f"{who}: {folder(label)}/ unreadable ({e.strerror or e})"
    if errors:
        return f"{who}: {folder(label)}/{errors[0]} exists (a rank failed) but manifest.json says ok"
    for r in range(degree):
        m = world_file(d, rank_marker(r, "done"))
        if not os.path.isfile(m) or os.path.islink(m):
            return f"{who}: {folder(label)}/{rank_marker(r, 'done')} is missing (the rank never finished its work)"
    return None


def _num(v):
    """A summary number as a float: JSON carries Inf/NaN as the strings "Infinity"/"NaN" (io.json_safe)."""
    if isinstance(v, str) and v in ("Infinity", "-Infinity", "NaN"):
        return float(v.replace("Infinity", "inf"))
    return v


def _same(a, b) -> bool:
    a, b = _num(a), _num(b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if type(a) in (int, float) and type(b) in (int, float):
        return float(a) == float(b)  # CSV and JSON both write floats by repr: exact
    return a == b


def _number_problems(degrees: dict, rows: list[dict] | None) -> list[str]:
    """The numbers summary.json shows (the first divergence's and each finding's max abs, ULP, mismatch
    fraction, bound) must be diff.csv's for the same record: the report prints them as written, so an
    edit to summary.json alone (a divergence edited to 0 ULP) must not read as evidence."""
    if rows is None:
        return []
    by_key = {(str(r.get("degree")), r.get("key")): r for r in rows}
    out = []
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else None
        recs = [("first divergence", fd, ("max_abs", "max_ulp", "mismatch_fraction", "bound"))] if fd else []
        recs += [("finding", f, ("max_abs", "bound")) for f in d.get("findings") or ()
                 if isinstance(f, dict) and f.get("key") and f.get("cause") != "router-flip"]
        for what, rec, fields in recs:
            key = rec.get("key")
            if not key:
                continue
            r = by_key.get((lab, key))
            if r is None:
                out.append(f"summary.json's TP={lab} {what} {key} is not a record of diff.csv")
                break
            if what == "finding" and r.get("rank_consistent") is False:
                fields = ("bound",)  # its max abs is between the ranks' copies, not in diff.csv
            bad = next((k for k in fields if k in rec and r.get(k) is not None and not _same(rec[k], r[k])), None)
            if bad:
                out.append(f"summary.json's TP={lab} {what} {key}: {bad} {rec[bad]!r} but diff.csv says "
                           f"{r[bad]!r} (edited after the run)")
                break
    return out


def problems(run_dir: str, manifest, summary, rows: list[dict] | None = None) -> list[str]:
    """Every disagreement between manifest.json, summary.json, diff.csv's rows (when given) and the
    per-rank evidence, in words."""
    out: list[str] = []
    if not isinstance(manifest, dict):
        return [f"{run_dir}/manifest.json: not a JSON object"]
    if not isinstance(summary, dict) or not isinstance(summary.get("degrees"), dict):
        return [f"{run_dir}/summary.json: no 'degrees' table (not a tpdiag summary)"]
    if not schema_ok(manifest.get("schema")):
        out.append(f"manifest.json schema {manifest.get('schema')!r}: this tpdiag reads schema {SCHEMA}")
    if not schema_ok(summary.get("schema")):
        out.append(f"summary.json schema {summary.get('schema')!r}: this tpdiag reads schema {SCHEMA}")
    if summary.get("status") not in STATUSES:
        out.append(f"summary.json status {summary.get('status')!r}: expected one of {', '.join(STATUSES)}")
    from tpdiag.records.axes import entries

    degrees = entries(summary)
    statuses = {lab: (d or {}).get("status") if isinstance(d, dict) else None for lab, d in degrees.items()}
    if summary.get("status") == "bitwise" and any(s != "bitwise" for s in statuses.values()):
        lab = next(lab for lab, s in statuses.items() if s != "bitwise")
        out.append(f"summary.json says bitwise but TP={lab} is {statuses[lab]}")
    if summary.get("status") == "divergent" and "divergent" not in statuses.values():
        out.append("summary.json says divergent but no degree is divergent")
    if summary.get("status") != "inconclusive" and "failed" in statuses.values():
        lab = next(lab for lab, s in statuses.items() if s == "failed")
        out.append(f"summary.json says {summary.get('status')} but TP={lab} failed")
    out += _number_problems(degrees, rows)
    for lab, st in statuses.items():
        div = [r for r in rows or () if str(r.get("degree")) == lab
               and (r.get("bitwise") is False or r.get("rank_consistent") is False)]
        if st == "bitwise" and div:
            out.append(f"summary.json says TP={lab} is bitwise but diff.csv has {len(div)} divergent records")
    from tpdiag.records.rundir import is_diff_dir

    if is_diff_dir(run_dir, manifest):
        return out  # `tpdiag diff`: its evidence is the two captures, re-diffed by the gate
    if manifest.get("tool") != "tpdiag compare":
        # the per-rank checks below run whatever `tool` says: an edited field must not switch them off
        out.append(f"manifest.json tool {manifest.get('tool')!r}: a run directory of tpdiag compare says "
                   "'tpdiag compare' (a tpdiag diff directory holds no tp folders and no worlds)")
    worlds = manifest.get("worlds")
    labels = manifest.get("labels")
    if not isinstance(worlds, dict) or not isinstance(labels, list) or not labels:
        out.append("manifest.json lists no worlds or labels (not a complete tpdiag compare run)")
        return out
    labels = [str(x) for x in labels]
    if str(manifest.get("reference")) != labels[0]:
        out.append(f"manifest.json reference {manifest.get('reference')!r} is not its first label {labels[0]!r}")
    for lab in labels[1:]:
        if lab not in degrees:
            out.append(f"manifest.json lists TP={lab}, absent from summary.json")
    base = summary.get("baseline") if isinstance(summary.get("baseline"), dict) else None
    base_label = str(base["label"]) if base and base.get("label") is not None else None
    if base_label is not None and base_label not in worlds:
        out.append(f"summary.json reports the reference rerun TP={base_label}, which manifest.json never ran")
    for lab in labels + ([base_label] if base_label in worlds else []):
        w = worlds.get(lab)
        if not isinstance(w, dict):
            out.append(f"TP={lab}: no world in manifest.json")
            continue
        if w.get("status") != "ok":
            if statuses.get(lab) not in (None, "failed") or (lab == labels[0] and summary.get("status") != "inconclusive"):
                out.append(f"TP={lab}: manifest.json says the world {w.get('status')} but summary.json does not")
            continue
        why = _world_problem(run_dir, manifest, lab, w.get("degree"), base_label)
        if why:
            out.append(why)
    return out
