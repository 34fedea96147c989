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


def _confirmation(run_dir: str, lab: str, entry: dict, seen: dict, check) -> tuple[str | None, set]:
    """(problem or None, the record keys the confirmation's records have bitwise) for one configuration."""
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
            bad = check(d, m, s, rows)
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
        moved = after is None or (isinstance(fd.get("idx"), int) and isinstance(after.get("idx"), int)
                                  and after["idx"] > fd["idx"])
        want = "confirmed" if fd.get("key") in bitwise and moved else "not-confirmed"
        said = (conf.get("first_divergence_after") or {}).get("key")
        if said != (after or {}).get("key"):
            return (f"{where}: summary.json says the first divergence moves to {said!r}, its records say "
                    f"{(after or {}).get('key')!r} (edited after the run)"), set()
    if conf.get("verdict") in ("confirmed", "not-confirmed") and conf["verdict"] != want:
        return f"{where}: summary.json says {conf['verdict']} but its records say {want} (edited after the run)", set()
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

    out, seen = [], {}
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
            bad, bitwise = _confirmation(run_dir, lab, entry, seen, check)
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
                tp = [(confs.get(x) or {}).get("tp") for x in (ref, lab)]
                ok = tp == [1, 1]
            else:
                ok = False
            if not ok:
                out.append(f"summary.json's TP={lab} finding {key} reads {f.get('cause')!r} over locate's "
                           f"{f.get('cause_before')!r}, which the run's own files do not support (edited after the run)")
                break
    return out
