"""Where a compare's time went: `manifest.json` `time_breakdown`, built once the whole command
(first pass, second pass, confirmations or fix chain) is done, from the manifests it wrote.

`parts` are disjoint stretches of the command, in the order they ran, so they add up to at most
`wall_s`; what no part measured (the session's own bookkeeping, the confirm loop between its
reruns) is the last part, `other`. `totals` are sums over every world the command ran (first
pass, reference rerun, second pass, confirmations, fix-chain rounds) of each world's phase (its
slowest rank's), so they overlap the parts and each other: they say what the worlds spent their
time on - building models, compiling kernels, the float64 re-execution. The reader and
validator (a foreign or hand-edited manifest) is tpdiag/records/timing.py.
"""
from __future__ import annotations

import glob
import os

from tpdiag.records.paths import RunDir
from tpdiag.records.paths import SECOND_PASS_DIRS
from tpdiag.records.timing import SCHEMA, TOTALS



def _read(path: str) -> dict:
    from tpdiag.records.rundir import read_manifest

    try:
        m = read_manifest(path)
    except Exception:  # noqa: BLE001 - a rerun that wrote no manifest has no time to report
        return {}
    return m if isinstance(m, dict) else {}


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _world_totals(manifest: dict, into: dict) -> None:
    for w in (manifest.get("worlds") or {}).values():
        t = (w or {}).get("timings") if isinstance(w, dict) else None
        if not isinstance(t, dict):
            continue
        into["worlds"] += 1
        get = lambda k: _num(t.get(k)) or 0.0  # noqa: E731
        into["start_s"] += get("spawn_s") + get("setup_s") + get("process_group_s")
        into["model_build_s"] += get("model_s") + get("selfcheck_model_s")
        into["selfcheck_s"] += get("selfcheck_s")
        into["steps_s"] += get("steps_s")
        into["gather_s"] += get("gather_s")
        into["write_s"] += get("write_s")
        into["float64_s"] += get("float64_s")
        if _num(t.get("triton_compile_s")) is not None:
            into["triton_compile_s"] = (into.get("triton_compile_s") or 0.0) + get("triton_compile_s")
            into["triton_compiles"] = (into.get("triton_compiles") or 0) + int(get("triton_compiles"))


def _linked(w) -> bool:
    """A world that did not run: an earlier pass's records stood in for it (runner/compare.py _linked)."""
    return isinstance(w, dict) and isinstance(w.get("records_from"), str)


def _worlds_wall(manifest: dict) -> dict:
    # a linked world's 0 s is not a world that ran in no time: it is named in the part's `what`
    return {lab: _num(w.get("wall_s")) for lab, w in (manifest.get("worlds") or {}).items()
            if isinstance(w, dict) and not _linked(w)}


def _diff_s(manifest: dict) -> float:
    return _num((manifest.get("phases") or {}).get("diff_s")) or 0.0


def _pass_what(d: str, manifest: dict) -> str:
    """A second pass's folder, and which of its worlds ran at once (runner/side_by_side.run_beside):
    their walls in the part's `worlds` overlap then, and the part's `s` is the time they took together;
    and which did not run (linked: the own-input pass's worlds other than its reference)."""
    from tpdiag.base.points import config_name

    worlds = manifest.get("worlds") or {}
    notes = [f"{config_name(lab)} beside {config_name(w['beside'])} on GPU {w.get('gpu')}"
             for lab, w in worlds.items() if isinstance(w, dict) and isinstance(w.get("beside"), str)]
    linked = [config_name(lab) for lab, w in worlds.items() if _linked(w)]
    if linked:
        notes.append(f"{', '.join(linked)} not run: an earlier pass's records")
    return f"{d} ({'; '.join(notes)})" if notes else d


def _first_pass(manifest: dict, parts: list) -> None:
    phases = manifest.get("phases") or {}
    if _num(phases.get("setup_s")) is not None:
        parts.append({"part": "setup", "what": "compare's checks, device, manifest", "s": phases["setup_s"]})
    from tpdiag.base.points import config_name

    ref = str(manifest.get("reference"))
    for lab, w in (manifest.get("worlds") or {}).items():
        if not isinstance(w, dict) or _num(w.get("wall_s")) is None:
            continue
        what = (f"{config_name(ref)} (reference)" if lab == ref else
                f"{config_name(ref)} (reference rerun)" if lab == f"{ref}-base" else config_name(lab))
        s = w["wall_s"]
        beside = (manifest.get("worlds") or {}).get(w.get("beside")) if w.get("beside") else None
        if isinstance(beside, dict) and _num(beside.get("wall_s")) is not None:
            # run at once with that world (runner/side_by_side.py): parts stay disjoint, so this
            # one is only what it ran past the other's end
            what += f" - {s:.1f} s beside it on GPU {w.get('gpu')}"
            s = round(max(0.0, s - beside["wall_s"]), 3)
        parts.append({"part": "world", "what": what, "label": lab, "s": s})
    if _num(phases.get("diff_s")) is not None:
        parts.append({"part": "diff", "what": "align, compare, locate, judge", "s": phases["diff_s"]})


def breakdown(run_dir: str, wall_s: float, second_pass_s: float | None = None,
              checks_s: float | None = None) -> dict:
    """The `time_breakdown` of the compare whose run directory is `run_dir` and whose whole
    command took wall_s (see the module docstring); checks_s: the command's own input checks
    before the session (the CLI's: model config, plan, memory preflight, the fork server's start)."""
    parts: list[dict] = []
    if checks_s is not None:
        parts.append({"part": "checks", "what": "input checks, memory preflight, fork server start",
                      "s": checks_s})
    totals = {k: 0.0 for k in TOTALS if k not in ("triton_compile_s", "triton_compiles")}
    totals["worlds"] = 0
    first = _read(run_dir)
    _first_pass(first, parts)
    _world_totals(first, totals)
    subs = [(d, _read(os.path.join(run_dir, d))) for d in SECOND_PASS_DIRS
            if os.path.isfile(RunDir(os.path.join(run_dir, d)).manifest)]
    if second_pass_s is not None:
        parts.append({"part": "second-pass", "what": ", ".join(_pass_what(d, m) for d, m in subs) or "second pass",
                      "s": second_pass_s, "worlds": {f"{d}/{k}": v for d, m in subs
                                                     for k, v in _worlds_wall(m).items()},
                      "diff_s": round(sum(_diff_s(m) for _, m in subs), 3)})
    for _, m in subs:
        _world_totals(m, totals)
    for kind, pattern in (("confirm", "confirm/*"), ("fix-chain", "auto/round*")):
        for path in sorted(glob.glob(os.path.join(run_dir, pattern)),
                           key=lambda p: (len(p), p)):  # round2 before round10
            m = _read(path)
            if _num(m.get("wall_s")) is None:
                continue
            parts.append({"part": kind, "what": os.path.basename(path), "s": m["wall_s"],
                          "worlds": _worlds_wall(m), "diff_s": _diff_s(m)})
            _world_totals(m, totals)
    for p in parts:
        p["s"] = round(max(0.0, float(p["s"])), 3)
    wall_s = round(max(wall_s, 0.0), 3)
    parts.append({"part": "other", "what": "not in any part above",
                  "s": round(max(0.0, wall_s - sum(p["s"] for p in parts)), 3)})
    return {"schema": SCHEMA, "wall_s": wall_s, "parts": parts,
            "totals": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in totals.items()}}
