"""A bug verdict that a later pass overrode must be re-derivable from that pass's own files.

Three passes may relabel a record locate called a bug (sharding-bug, rank-inconsistent-replica) as
rounding, keeping the old label as `cause_before` (diff/judge.py's rules): the confirmation (the
confirming fix makes the record bitwise, or the record lies downstream of a confirmed cause), the
second pass (re-executed from this side's own inputs it is within rounding), and the grad norm's
rule between two TP=1 worlds. summary.json alone said so: a sharding-bug and a rank-inconsistent
replica relabelled there, with a confirmation edited to `confirmed`, passed `gate --allow rounding`
(exit 0). Here the confirmation is re-derived from its own run directory (its records re-read and
re-diffed like any run's: diff/evidence.py), and each override must be what that pass's files say.
"""
from __future__ import annotations

import os

from tpdiag.errors import Inconclusive
from tpdiag.records.moved import moved_later, record_order
from tpdiag.records.paths import RunDir

_CONFIRMING = "the confirming fix ("        # judge.py's words for each rule's `why`
_DOWNSTREAM = "downstream of the confirmed "
_OWN = "re-executed in float64 from this side's own inputs it is within rounding"


def _confirm_dir(run_dir: str, conf: dict) -> str | None:
    """The confirmation's run directory beside this run (compare writes RUN_DIR/confirm/<fix>; a moved run
    directory still finds it), or None where the summary names none."""
    if not conf.get("run_dir"):
        return None
    return RunDir(run_dir).confirm_run(os.path.basename(str(conf["run_dir"]).rstrip("/")))


def _confirmation(run_dir: str, lab: str, entry: dict, seen: dict, check, manifest: dict,
                  settled: frozenset = frozenset()) -> tuple[str | None, set]:
    """(problem or None, the record keys the confirmation's records have bitwise) for one configuration.
    settled: the configurations whose main verdict fails the gate on its own (diff/moved_records.settled)."""
    from tpdiag.records.rundir import read_manifest, read_rows, read_summary

    conf = entry.get("confirmation")
    d = _confirm_dir(run_dir, conf) if isinstance(conf, dict) else None
    if d is None:
        return None, set()
    if conf.get("fix") and os.path.basename(d) != str(conf["fix"]):
        return f"summary.json's TP={lab} confirmation of {conf['fix']!r} names the run of another fix ({d})", set()
    if d not in seen:
        try:
            m, s, rows = read_manifest(d), read_summary(d), read_rows(RunDir(d).diff_csv)
            # this run's own rerun first: another run's confirm/<fix>/ copied in (another seed, another
            # model) agrees with itself and confirmed that run's divergence, not this one's (red team hred10)
            from tpdiag.records.sides import pass_identity_problem

            why = pass_identity_problem(manifest, m, os.path.relpath(d, run_dir),
                                        tuple(os.path.basename(d).split("+")), here=d)
            bad = [why] if why else check(d, m, s, rows, rerun=True, settled=settled)
            if not bad and m.get("status") is None:
                bad = ["manifest.json has no final status (the rerun never finished)"]
            seen[d] = (bad[0] if bad else None, s, rows)
        except Inconclusive as e:
            seen[d] = (str(e).splitlines()[0], None, None)
    bad, s, rows = seen[d]
    where = f"the confirmation of TP={lab} ({os.path.relpath(d, run_dir)})"
    if bad:
        return f"{where}: {bad}", set()
    from tpdiag.records.axes import entries

    after_entry = entries(s).get(lab) or {}
    bitwise = {r["key"] for r in rows if r["degree"] == lab and r["bitwise"] is True
               and r.get("rank_consistent") is not False}
    fd = entry.get("first_divergence") or {}
    if after_entry.get("status") == "failed":
        want = "not-confirmed"
    else:
        after = after_entry.get("first_divergence")
        if ("order", lab) not in seen:
            seen[("order", lab)] = record_order(run_dir, lab)
        moved = moved_later(fd, after, seen[("order", lab)])
        want = "confirmed" if fd.get("key") in bitwise and moved else "not-confirmed"
        if want == "confirmed" and conf.get("verdict") == "not-confirmed" and not moved_later(fd, after, {}):
            # a run written before the confirmed run's order was read (the rerun's own idx): the
            # more cautious verdict it wrote stands (records/moved.py)
            want = "not-confirmed"
        said = (conf.get("first_divergence_after") or {}).get("key")
        if said != (after or {}).get("key"):
            return (f"{where}: summary.json says the first divergence moves to {said!r}, its records say "
                    f"{(after or {}).get('key')!r} (edited after the run)"), set()
    if conf.get("verdict") in ("confirmed", "not-confirmed") and conf["verdict"] != want:
        return f"{where}: summary.json says {conf['verdict']} but its records say {want} (edited after the run)", set()
    after = after_entry.get("first_divergence")
    from tpdiag.records.causes import cause_class

    if want == "confirmed" and isinstance(after, dict) and cause_class(after.get("cause")) == "bug" and not any(
            isinstance(f, dict) and f.get("key") == after.get("key") and f.get("from") == f"confirmation ({conf.get('fix')})"
            for f in entry.get("findings") or ()):
        # runner/confirm._bug_after files the bug the rerun found at its next first divergence: fixes only
        # reorder, so it is this run's bug too - removed from summary.json, the run passed as rounding
        return (f"{where}: its rerun found {after.get('cause')} at {after.get('key')}, which summary.json's findings "
                "lack (edited after the run)"), set()
    return None, bitwise if want == "confirmed" else set()


def _own_near(run_dir: str, summary: dict, lab: str) -> set:
    """The records the second pass found within their bound (re-executed on this side's own inputs)."""
    sp = summary.get("second_pass")
    if not isinstance(sp, dict):
        return set()
    from tpdiag.records.paths import SECOND_PASS_DIRS
    from tpdiag.records.rundir import read_rows

    name = os.path.basename(str(sp.get("dir") or "").rstrip("/"))
    if name not in SECOND_PASS_DIRS:
        return set()  # records/integrity.py says so
    try:
        rows = read_rows(RunDir(os.path.join(run_dir, name)).diff_csv)
    except Inconclusive:
        return set()
    return {r["key"] for r in rows if r["degree"] == lab and r.get("beyond_bound") is False}


def problems(run_dir: str, manifest: dict, summary: dict, check) -> list[str]:
    """Every confirmation summary.json states that its own run does not give, and every bug verdict
    overridden by a rule whose evidence is not in the run directory, in words. check: diff/evidence.py's
    problems(run_dir, manifest, summary, rows), run on the confirmation's own run directory."""
    from tpdiag.records.axes import entries
    from tpdiag.records.causes import cause_class

    from tpdiag.diff.moved_records import settled as fails_alone

    out, seen = [], {}
    settled = frozenset(lab for lab, e in entries(summary).items() if fails_alone(e))
    confs = manifest.get("configurations") if isinstance(manifest.get("configurations"), dict) else {}
    ref = str(manifest.get("reference"))
    for lab, entry in entries(summary).items():
        if not isinstance(entry, dict):
            continue
        relabelled = [f for f in entry.get("findings") or () if isinstance(f, dict)
                      and cause_class(f.get("cause_before")) == "bug" and cause_class(f.get("cause")) != "bug"]
        conf = entry.get("confirmation") if isinstance(entry.get("confirmation"), dict) else {}
        d = _confirm_dir(run_dir, conf)
        confirmed, bitwise = False, set()
        if d is None:
            if conf.get("verdict") == "confirmed":
                out.append(f"summary.json's TP={lab} confirmation says confirmed but names no rerun (edited after the run)")
                continue
        elif conf.get("verdict") == "confirmed" or relabelled or os.path.isdir(d):
            # (a confirmation that clears nothing lets nothing through: a rerun that wrote nothing is not asked for)
            bad, bitwise = _confirmation(run_dir, lab, entry, seen, check, manifest, settled)
            if bad:
                out.append(bad)
                continue
            confirmed = conf.get("verdict") == "confirmed"
        near = None
        for f in relabelled:
            why, key = str(f.get("why") or ""), f.get("key")
            if why.startswith(_CONFIRMING):
                ok = confirmed and key in bitwise
            elif why.startswith(_DOWNSTREAM):
                ok = confirmed
            elif _OWN in why:
                near = _own_near(run_dir, summary, lab) if near is None else near
                ok = key in near
            elif f.get("kind") == "grad_norm" and f.get("cause") == "grad-norm":
                ok = [_tp(run_dir, manifest, confs, x) for x in (ref, lab)] == [1, 1]
            else:
                ok = False
            if not ok:
                out.append(f"summary.json's TP={lab} finding {key} reads {f.get('cause')!r} over locate's "
                           f"{f.get('cause_before')!r}, which the run's own files do not support (edited after the run)")
                break
    return out + _unreported(run_dir, manifest, summary)


def _tp(run_dir: str, manifest: dict, confs: dict, label: str):
    """A configuration's TP degree: compare's manifest says it; a `tpdiag diff` directory's worlds are the
    captures, whose world.json says it (diff/analyse.py reads the same field)."""
    if label in confs:
        return (confs.get(label) or {}).get("tp")
    from tpdiag.records.rundir import is_diff_dir, records_dir

    if not is_diff_dir(run_dir, manifest):
        return None
    from tpdiag.base.files import read_json
    from tpdiag.records.paths import WORLD

    try:
        w = read_json(os.path.join(records_dir(run_dir, manifest, label), WORLD))
    except Inconclusive:
        return None
    return w.get("degree") if isinstance(w, dict) else None


def _unreported(run_dir: str, manifest: dict, summary: dict) -> list[str]:
    """A confirmation that ran must be in summary.json: runner/session.py confirms every divergent
    configuration of a compare run with --confirm (a verdict for each: confirmed, not-confirmed or
    no-fix), and a rerun of this run's in confirm/<fix>/ is named by the configuration it confirmed. A
    confirmation removed from summary.json (with the bug only its rerun found, and its folder) passed the
    gate as a run never confirmed (red team hred10)."""
    from tpdiag.records.axes import entries
    from tpdiag.records.rundir import read_manifest
    from tpdiag.records.sides import started

    every = {lab: e for lab, e in entries(summary).items() if isinstance(e, dict)}
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    if cfg.get("confirm") is True and cfg.get("fix_mode") != "auto" and summary.get("status") == "divergent":
        for lab, e in every.items():
            conf = e.get("confirmation")
            if e.get("status") == "divergent" and isinstance(e.get("first_divergence"), dict) and not (
                    isinstance(conf, dict) and conf.get("verdict") in ("confirmed", "not-confirmed", "no-fix")):
                return [f"summary.json's TP={lab} has no confirmation, but the run confirmed every divergent "
                        "configuration (manifest.json: confirm true; edited after the run)"]
            why = _no_fix_problem(lab, e, cfg) if isinstance(conf, dict) and conf.get("verdict") == "no-fix" else None
            if why:
                return [why]
    named = {os.path.basename(str(e["confirmation"]["run_dir"]).rstrip("/")) for e in every.values()
             if isinstance(e.get("confirmation"), dict) and e["confirmation"].get("run_dir")}
    mine = started(manifest)
    try:
        folders = sorted(os.listdir(os.path.join(run_dir, "confirm")))
    except OSError:
        folders = []
    for name in folders:
        sub = RunDir(run_dir).confirm_run(name)
        if name in named or not os.path.isfile(RunDir(sub).manifest):
            continue
        try:
            theirs = started(read_manifest(sub))
        except Inconclusive:
            theirs = mine  # unreadable: not proven an earlier run's
        if mine is None or theirs is None or theirs >= mine:
            return [f"confirm/{name}/ holds a confirmation rerun of this run (started after it) that no configuration "
                    "of summary.json names (its confirmation removed, or edited after the run)"]
    return []


def _no_fix_problem(lab: str, entry: dict, cfg: dict) -> str | None:
    """runner/confirm.py says no-fix only where no fix in the catalogue removes the located cause, or every
    one that does was already on: a no-fix over a cause a fix removes hides the rerun's verdict."""
    from tpdiag.fixes.registry import catalogue, fixes_for_cause

    fd = entry["first_divergence"]
    on = cfg.get("fixes") if isinstance(cfg.get("fixes"), list) else []
    fix = entry["confirmation"].get("fix")
    if isinstance(fix, str) and fix and set(fix.split("+")) <= set(on):
        return None  # `tpdiag confirm --fix X` with X already on: nothing to rerun
    names = fixes_for_cause(str(fd.get("cause")), fd.get("op"))
    left = tuple(n for n in names if n not in on)
    if left and all(catalogue()[n].install is not None for n in left):
        return (f"summary.json's TP={lab} confirmation says no-fix, but {'+'.join(left)} removes its cause "
                f"{fd.get('cause')!r} and was not on (edited after the run)")
    return None
