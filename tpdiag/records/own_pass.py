"""Whether the own-input pass after a hash-first region pass (region/ops/, runner/drill.py) ran, so that
its folder and summary.json must be there (records/integrity.py reads this)."""
from __future__ import annotations

import os

from tpdiag.errors import Inconclusive
from tpdiag.records.sides import started


def own_pass_wanted(sp: dict, region: dict) -> bool:
    """Whether runner/drill.py ran the own-input pass after a hash-first region pass: with a confirmation,
    for the modules the confirming fix left divergent (summary.json's second_pass.own_after_confirm), else
    for every module the region pass left to judge (_judge_own_after_hash)."""
    from tpdiag.records.axes import entries

    late = sp.get("own_after_confirm")
    if isinstance(late, dict):
        return any(late.values())
    return region.get("status") == "divergent" and any(
        isinstance(d, dict) and d.get("own_inputs") for d in entries(region).values())


def ran_here(run_dir: str, nested: str) -> str | None:
    """One line when the pass in `nested` is this run's (started after it) but has no summary.json."""
    from tpdiag.records.rundir import RunDir, read_manifest

    try:
        mine, theirs = started(read_manifest(run_dir)), started(read_manifest(os.path.join(run_dir, nested)))
    except Inconclusive:
        mine = theirs = None  # unreadable: not proven an earlier run's
    if mine is not None and theirs is not None and theirs < mine:
        return None
    return (f"the second pass's own-input pass {nested}/ ran (its manifest.json is there) but its summary.json is "
            f"missing: {RunDir(os.path.join(run_dir, nested)).summary} (deleted, or the run was cut short)")
