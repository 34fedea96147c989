"""The reference rerun's account (summary.json's baseline) against the compare that ran it: a rerun
that failed or did not reproduce the reference leaves the run inconclusive (diff/analyse.py), so its
account cannot be removed or contradicted (records/integrity.py reads this)."""
from __future__ import annotations


def baseline_problems(manifest: dict, summary: dict, base: dict | None) -> list[str]:
    """The reference rerun decides whether anything else may be blamed (diff/analyse.py): one that failed
    or did not reproduce the reference makes the run inconclusive. A compare configured with a rerun
    (config baseline true, the reference's degree listed once: runner/compare.py) reports it; its
    baseline, and the rerun's world with it, removed from both files, with the status made divergent,
    passed the gate as a run whose reference reproduced (red team hred10)."""
    if summary.get("status") == "inconclusive":
        return []
    if base is not None:
        w = (manifest.get("worlds") or {}).get(str(base.get("label")))
        if base.get("label") is None:
            # diff/analyse.py names its rerun always: without the name its records are never re-read
            return ["summary.json's baseline names no reference rerun (edited after the run)"]
        if base.get("reproducible") is True and not (isinstance(w, dict) and w.get("status") == "ok"):
            return [f"summary.json says the reference rerun TP={base['label']} reproduced the reference but "
                    f"manifest.json says its world {w.get('status') if isinstance(w, dict) else 'never ran'} "
                    "(edited after the run)"]
        if base.get("reproducible") is not True:
            what = "failed" if base.get("reproducible") is None else "did not reproduce the reference"
            return [f"summary.json says the reference rerun TP={base.get('label')} {what}, but the run's status is "
                    f"{summary.get('status')!r}, not inconclusive (edited after the run)"]
        return []
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    degs = cfg.get("degrees")
    if cfg.get("baseline") is True and isinstance(degs, list) and degs and degs.count(degs[0]) == 1:
        return ["manifest.json's config ran a reference rerun (baseline true) but summary.json reports no baseline "
                "(removed, or edited after the run)"]
    return []
