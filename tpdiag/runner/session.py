"""What `tpdiag compare` does end to end: the compare, then confirmation or the auto fix chain."""
from __future__ import annotations

import os
import time

from tpdiag.config import CompareConfig
from tpdiag.records.paths import RunDir


def compare_session(cfg: CompareConfig, on_status=None, started: float | None = None) -> dict:
    """started: time.perf_counter() when the command began (its input checks are then the
    breakdown's first part, `checks`)."""
    from tpdiag.diff import pair_memo
    from tpdiag.runner.start_context import refuse_rerun

    refuse_rerun()  # a rank re-running its script's unguarded call leaves before any check or world
    # the own-input pass's diff reads the region diff's pairs again: measured once per compare,
    # each stored tensor hash-checked once per compare (records/checked.py)
    with pair_memo.read_once(_check_device(cfg)):
        return _session(cfg, on_status, started)


def _check_device(cfg: CompareConfig):
    """Where this process re-hashes the big records it reads (records/hashing.checks_on): the
    first GPU when the worlds run on GPUs and it is in the default compute mode (base/gpu_shared)
    - never under TPDIAG_START_METHOD=fork (a rank forked from a process holding a CUDA context
    cannot use CUDA); TPDIAG_CHECK_DEVICE=cpu: the host."""
    where = os.environ.get("TPDIAG_CHECK_DEVICE", "auto")
    if where not in ("auto", "cpu"):
        from tpdiag.errors import BadInput

        raise BadInput(f"TPDIAG_CHECK_DEVICE={where!r}: expected auto or cpu")
    if where == "cpu" or os.environ.get("TPDIAG_START_METHOD", "forkserver") == "fork":
        return None
    from tpdiag.base.gpu_shared import shareable
    from tpdiag.models.capacity import guess_device

    return "cuda:0" if guess_device(cfg.device, cfg.degrees) == "cuda" and shareable(0) else None


def _session(cfg: CompareConfig, on_status=None, started: float | None = None) -> dict:
    from tpdiag.runner.compare import compare_pass
    from tpdiag.runner.confirm import auto_chain, confirm

    from tpdiag.fixes import groups

    t0 = time.perf_counter()
    if started is not None:
        checks_s = t0 - started
        t0 = started
    else:
        checks_s = None
    # G once for the whole session: the drill-down, confirm and fix-chain reruns keep it
    cfg = groups.resolve(cfg)
    from tpdiag.records.run_files import drop_stale_report

    drop_stale_report(cfg.out)
    if cfg.fix_mode == "auto":
        summary, files = auto_chain(cfg, cfg.out, on_status)
        # round 0's summary as its round wrote it (the run the user asked for), with the chain's parts
        first = dict(files.written)
        first["fix_chain"] = summary["fix_chain"]
        first["status_after_fixes"] = summary["status"]
        from tpdiag.runner.confirm import final_class

        # the verdict is the last round's (a bug of any round), not round 0's alone
        first["class_round0"] = first.get("class")
        first["class"] = final_class(summary["fix_chain"])
        first["timings"] = _timings(files, {"fix_chain_s": time.perf_counter() - t0}, t0, checks_s)
        files.summary(first)
        # how many rounds ran, beside the status: a chain cut from summary.json is then seen (records/sides.py)
        files.add(fix_chain_rounds=len(summary["fix_chain"]), status=first["status"])  # last: complete from here on
        first["run_dir"] = cfg.out
        return first
    # the manifest's status is written last, after the second pass and the confirmation: a compare
    # killed between them leaves an incomplete run, never the first pass's summary as the verdict
    summary, files = compare_pass(cfg.with_(granularity="module") if cfg.granularity == "auto" else cfg,
                                  on_status, finish=False)
    extra = {}
    from tpdiag.runner.drill import wanted

    # with a confirmation to come, the own-input pass after a region pass waits for it
    # (runner/drill.py: it then judges only what the confirming fix leaves divergent)
    later: list = [] if cfg.confirm else None
    if wanted(cfg, summary):
        from tpdiag.records.hashing import check_device, warm
        from tpdiag.runner.drill import drill_down

        # the second-pass diff re-hashes GBs on the parent's GPU: its CUDA context and kernel
        # compile (~3.5 s) start now, behind the region pass's worlds
        warm(check_device())
        t1 = time.perf_counter()
        summary = drill_down(cfg, summary, cfg.out, on_status, later=later)
        extra["second_pass_s"] = time.perf_counter() - t1
    from tpdiag.records.judgeable import judgeable

    # a failed configuration's world leaves the others confirmed all the same (the run stays inconclusive)
    if cfg.confirm and judgeable(summary):
        t1 = time.perf_counter()
        summary = confirm(cfg, summary, cfg.out, on_status=on_status)
        extra["confirm_s"] = time.perf_counter() - t1
    for job in later or ():
        t1 = time.perf_counter()
        job(summary)
        extra["second_pass_s"] = extra.get("second_pass_s", 0.0) + time.perf_counter() - t1
    extra["compare_s"] = time.perf_counter() - t0
    from tpdiag.diff.classes import add_classes

    add_classes(summary)  # the second pass may have judged a first divergence bug or rounding
    summary["timings"] = _timings(files, extra, t0, checks_s)
    files.summary(summary)
    files.add(status=summary["status"])  # last: the run directory is complete from here on
    return summary


def _timings(files, extra: dict, t0: float, checks_s: float | None = None) -> dict:
    """Wall time per phase of the whole compare and per world (manifest.json keeps the per-rank
    detail): the first pass's phases plus second pass / confirm / fix chain / total, the
    manifest's `phases` part, and the whole command's `time_breakdown` (runner/timing.py), added
    to the first pass's manifest (records/run_files.py). Every key is optional; readers must not
    rely on them."""
    from tpdiag.records.rundir import read_manifest
    from tpdiag.runner.timing import breakdown

    run_dir = files.run_dir.path
    phases = dict(files.manifest.get("phases") or {})
    phases.update({k: round(v, 3) for k, v in extra.items()})
    # measured last, so every part above lies inside it (from the manifests the passes wrote)
    total = breakdown(run_dir, time.perf_counter() - t0, extra.get("second_pass_s"), checks_s)
    files.add(phases=phases, time_breakdown=total)
    out = {"phases": phases, "worlds": _world_timings(files.manifest), "breakdown": total}
    # the second pass is a compare of its own in a subdirectory (runner/drill.py): its worlds'
    # split (start, steps, full-capture gather, write) is where a large model's time goes
    for hashed in (True, False):
        sub = RunDir(run_dir).second_pass(hashed)
        if os.path.isfile(RunDir(sub).manifest):
            sub_manifest = read_manifest(sub)
            out["second_pass_worlds"] = _world_timings(sub_manifest)
            out["second_pass_phases"] = sub_manifest.get("phases") or {}
            # after a hash-first pass the own-input judgement is one more pass inside it
            # (region/ops): its reference re-executes the downstream modules in float64 (13 of a
            # 56 s llama-1b compare on 2 H200s), timed apart so those seconds are not hidden
            own = RunDir(sub).second_pass(False)
            if hashed and os.path.isfile(RunDir(own).manifest):
                own_manifest = read_manifest(own)
                out["own_pass_worlds"] = _world_timings(own_manifest)
                out["own_pass_phases"] = own_manifest.get("phases") or {}
    return out


def _world_timings(manifest: dict) -> dict:
    # a world an earlier pass's records stood in for (runner/compare.py _linked) did not run: its
    # 0 s wall says so only beside where its records came from
    return {label: {"wall_s": w.get("wall_s"), **(w.get("timings") or {}),
                    **({"records_from": w["records_from"]} if isinstance(w.get("records_from"), str) else {})}
            for label, w in (manifest.get("worlds") or {}).items() if isinstance(w, dict)}
