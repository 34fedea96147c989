"""Did a run's second pass run, and did it finish? A second pass summary.json does not name, though it
ran, or one whose worlds failed: its float64 verdicts and the findings only it makes are missing
(records/integrity.py; compare's own exit code, cli/common.py)."""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
from tpdiag.records.paths import SECOND_PASS_DIRS
from tpdiag.records.sides import started


def unnamed_second_pass(run_dir: str, summary: dict, degrees: dict) -> list[str]:
    """summary.json names no second pass: then none ran. One that did - named by a first divergence, or
    its folder in the run directory started after this run did (an earlier compare's, in a reused
    directory, started before) - was removed from summary.json together with the findings only it made
    (a sharding-bug behind a harmless reordering would pass)."""
    for lab, d in degrees.items():
        fd = d.get("first_divergence") if isinstance(d, dict) else None
        if isinstance(fd, dict) and fd.get("second_pass_dir"):
            return [f"summary.json's TP={lab} first divergence names the second pass {fd['second_pass_dir']!r} but "
                    "summary.json has no second_pass (edited after the run)"]
    from tpdiag.records.rundir import RunDir, read_manifest

    try:
        mine = started(read_manifest(run_dir))
    except Inconclusive:
        return []  # problems() reports the manifest itself
    for name in SECOND_PASS_DIRS:
        sub = os.path.join(run_dir, name)
        if mine is None or "/" in name or not os.path.isfile(RunDir(sub).manifest):
            continue
        try:
            theirs = started(read_manifest(sub))
        except Inconclusive:
            theirs = mine  # unreadable: not proven an earlier run's
        if theirs is not None and theirs >= mine:
            return [f"{name}/ holds a second pass of this run (started after it) but summary.json names no second "
                    "pass (edited after the run, or the compare was stopped during it)"]
    return []


def pass_failed(sub) -> str | None:
    """Why a second pass's own summary says it judged nothing (a world failed, or it was inconclusive)."""
    from tpdiag.records.axes import entries

    if not isinstance(sub, dict) or not isinstance(sub.get("degrees"), dict):
        return None
    broken = next(((lab, d) for lab, d in entries(sub).items() if isinstance(d, dict) and d.get("status") == "failed"),
                  None)
    if broken:
        return f"TP={broken[0]}: {broken[1].get('error') or 'failed'}"
    return "inconclusive" if sub.get("status") == "inconclusive" else None


def failed_words(name: str, why: str) -> str:
    return (f"the second pass in {name}/ failed ({str(why).splitlines()[0][:300]}): its float64 verdicts and the "
            "findings only it makes are missing; run the compare again")


def second_pass_failed(run_dir: str, summary: dict) -> str | None:
    """One line when the run's second pass (or the own-input pass inside it) has worlds that failed:
    compare's own exit code is then 2 (DESIGN: a world failed - the result is inconclusive), as the
    gate's is. None where the run has no second pass or it finished."""
    from tpdiag.records.paths import SUMMARY

    sp = summary.get("second_pass") if isinstance(summary, dict) else None
    if not isinstance(sp, dict) or not run_dir:
        return None
    name = os.path.basename(str(sp.get("dir") or "").rstrip("/"))
    for sub_name in (name, os.path.join(name, "ops")):
        path = os.path.join(run_dir, sub_name, SUMMARY)
        if not os.path.isfile(path):
            continue
        try:
            why = pass_failed(io.read_json(path))
        except Inconclusive as e:
            why = str(e).splitlines()[0]
        if why:
            return failed_words(sub_name, why)
    return None
