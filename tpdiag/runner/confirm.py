"""Confirm a located cause by swapping in its fix and running again; `--fix auto` chains this.

A cause is confirmed when, with its fix on (at the reference too: a fix defines the canonical
order), the record that diverged first becomes bitwise equal and the first divergence moves
later or disappears. Each rerun lives in its own sub-directory with its own summary.
"""
from __future__ import annotations

import os

from tpdiag.config import CompareConfig, degree_labels
from tpdiag.records.moved import moved_later, record_order
from tpdiag.records.paths import RunDir
from tpdiag.runner import prefix


def _rerun(cfg: CompareConfig, out: str, degrees, fixes, baseline: bool = False, finish: bool = True):
    """(summary, RunFiles) of a rerun in `out` (finish: as compare_pass's)."""
    from tpdiag.runner.compare import compare_pass

    sub = cfg.with_(out=out, degrees=tuple(degrees), fixes=tuple(fixes), fix_mode="explicit",
                    confirm=False, baseline=baseline)
    return compare_pass(sub, finish=finish)


def _marked(cfg: CompareConfig, run_dir: str, out: str) -> CompareConfig:
    """cfg for a rerun in `out` inside the run run_dir, its folder there recorded (RerunSpec.pass_of):
    it runs fixes the user did not choose, so copied out of the run it is refused as a run of its own."""
    return cfg.with_(pass_of=os.path.relpath(out, run_dir).replace(os.sep, "/"))


def _key_bitwise(run_dir: str, label: str, key: str) -> bool | None:
    from tpdiag.records.rundir import read_rows

    path = RunDir(run_dir).diff_csv
    if not os.path.exists(path):
        return None
    for r in read_rows(path):
        if r["degree"] == label and r["key"] == key:
            return r["bitwise"] is True
    return None


def confirm(cfg: CompareConfig, summary: dict, run_dir: str, only_label: str | None = None,
            force_fix: str | None = None, on_status=None) -> dict:
    """Adds degrees[N].confirmation to `summary` (in place) and returns it."""
    from tpdiag.fixes import groups
    from tpdiag.fixes.registry import catalogue, fixes_for_cause

    cfg = groups.resolve(cfg)  # the run's G (chosen now for a run written before G was recorded)
    from tpdiag.records.axes import entries

    every = entries(summary)
    # configurations on other axes keep their labels in the rerun (CompareConfig.only)
    axes = bool(cfg.micro_batches) or tuple(cfg.modes) != ("prefill",)
    if axes:
        labels = [w.label for w in cfg.worlds()]
        members_of = list(zip(labels[1:], labels[1:]))
    else:
        labels = degree_labels(cfg.degrees)
        members_of = list(zip(labels[1:], cfg.degrees[1:]))
    ref_degree = cfg.degrees[0]
    plan: dict[str, list[tuple[str, int]]] = {}
    for label, degree in members_of:
        d = every.get(label, {})
        if only_label and label != only_label:
            continue
        if d.get("status") != "divergent" or not d.get("first_divergence"):
            continue
        cause = d["first_divergence"]["cause"]
        names = (force_fix,) if force_fix else fixes_for_cause(cause, d["first_divergence"].get("op"))
        names = tuple(n for n in names if n not in cfg.fixes) or names
        fix = "+".join(names) or None
        if fix is None or any(catalogue()[n].install is None for n in names) or set(names) <= set(cfg.fixes):
            d["confirmation"] = {"fix": fix, "verdict": "no-fix", "first_divergence_after": None,
                                 "reason": f"no available fix for cause {cause!r}"
                                 if not fix or not set(names) <= set(cfg.fixes) else f"{fix} was already on"}
            continue
        plan.setdefault(fix, []).append((label, degree))
    for fix, members in plan.items():
        if on_status:
            on_status("confirm", f"{fix}")
        out = RunDir(run_dir).confirm_run(fix)
        mcfg = _marked(cfg, run_dir, out)
        # decode configurations whose region pass reproduced the first divergence on the first
        # positions: confirmed on the same positions (runner/prefix.py)
        cut = {tuple(every[lab]["first_divergence"].get("positions") or ()) for lab, _ in members}
        cut = cut.pop() if len(cut) == 1 else ()
        if axes:
            sub, files = _rerun(mcfg.with_(only=tuple(lab for lab, _ in members), positions=cut[0] if cut else 0,
                                 prefix_from=prefix.decode_dir(run_dir, members[0][0]) if cut else ""),
                       out, cfg.degrees, list(cfg.fixes) + fix.split("+"), finish=False)
            sub_labels = [lab for lab, _ in members]
        else:
            sub, files = _rerun(mcfg, out, [ref_degree] + [deg for _, deg in members],
                                list(cfg.fixes) + fix.split("+"),
                                finish=False)
            sub_labels = degree_labels(tuple([ref_degree] + [deg for _, deg in members]))[1:]
        if not cut:
            sub = _judge_after(mcfg, sub, files, out, fix, [lab for lab, _ in members] if axes else None,
                               None if axes else [ref_degree] + [deg for _, deg in members], on_status)
        # the rerun's status goes last, after its own second pass (as compare_pass's finish)
        files.add(status=sub["status"])
        sub_every = entries(sub)
        for (label, _), sub_label in zip(members, sub_labels):
            before = every[label]["first_divergence"]
            after_entry = sub_every.get(sub_label, {})
            if after_entry.get("status") == "failed":
                every[label]["confirmation"] = {
                    "fix": fix, "verdict": "not-confirmed", "first_divergence_after": None,
                    "reason": f"rerun failed: {after_entry.get('error')}", "run_dir": out}
                continue
            after = after_entry.get("first_divergence")
            now_equal = _key_bitwise(out, sub_label, before["key"])
            moved = moved_later(before, after, record_order(run_dir, label))
            verdict = "confirmed" if (now_equal and moved) else "not-confirmed"
            every[label]["confirmation"] = {
                "fix": fix, "verdict": verdict, "first_divergence_after": after,
                "status_after": after_entry.get("status"), "run_dir": out,
                **({"not_carried": after_entry["not_carried"]} if after_entry.get("not_carried") else {}),
                **({"positions": list(cut)} if axes and cut else {})}
            from tpdiag.diff.classes import clear_by_confirmation
            from tpdiag.records.rundir import bitwise_keys

            clear_by_confirmation(every[label], bitwise_keys(out, sub_label))
            _bug_after(every[label], after, fix, sub_label)
    from tpdiag.diff.classes import add_classes

    add_classes(summary)  # every flow (compare, `tpdiag confirm`) ends with the confirmed verdict
    return summary


def _judge_after(cfg: CompareConfig, sub: dict, files, out: str, fix: str, only, degrees, on_status=None) -> dict:
    """The confirmation rerun's next first divergence, judged as a fix chain's round is where
    nothing named it (`unknown`): a wrong result that the confirmed rounding hid shows there (a
    residual added twice at TP > 1, behind the row-parallel sum's rounding), and a verdict of
    "rounding only" would let it through."""
    from tpdiag.records.axes import entries

    def shares(fd: dict) -> bool:
        # under hash capture, a forward input read as "shares that do not add up" from hashes alone
        # (runner/drill_merge._shares): its region pass reads them whole - without it a confirmed fix before
        # a correct model's own all-reduce module filed a BUG from the rerun (_bug_after)
        return (sub.get("capture") == "hash" and (fd.get("phase"), fd.get("kind")) == ("forward", "in")
                and fd.get("cause") == "sharding-bug" and fd.get("bound") is None)

    if not any((e.get("first_divergence") or {}).get("cause") == "unknown" or shares(e.get("first_divergence") or {})
               for e in entries(sub).values()):
        return sub
    fixes = tuple(cfg.fixes) + tuple(fix.split("+"))
    rcfg = cfg.with_(out=out, fixes=fixes, fix_mode="explicit", confirm=False, baseline=False)
    rcfg = rcfg.with_(only=tuple(only)) if only else rcfg.with_(degrees=tuple(degrees))
    return _drilled(rcfg, sub, files, out, on_status)


def _drilled(rcfg: CompareConfig, summary: dict, files, out: str, on_status=None) -> dict:
    """summary after its second pass, where rcfg wants one: judged, its classes added, its
    summary.json rewritten by its one writer (files)."""
    from tpdiag.diff.classes import add_classes
    from tpdiag.runner.drill import drill_down, wanted

    if not wanted(rcfg, summary):
        return summary
    summary = drill_down(rcfg, summary, out, on_status)
    add_classes(summary)
    files.summary(summary)
    return summary


def _bug_after(entry: dict, after: dict | None, fix: str, sub_label: str) -> None:
    """A bug the confirmation rerun found at its first divergence is a root finding of this
    configuration: fixes only reorder, so a wrong result under them is wrong without them."""
    from tpdiag.records.causes import cause_class

    if not after or cause_class(after.get("cause")) != "bug" or entry.get("confirmation", {}).get("verdict") != "confirmed":
        return
    from tpdiag.records.keys import RecordKey

    f = {k: after[k] for k in ("phase", "module", "op", "kind", "name", "step", "cause", "why", "max_abs",
                               "bound", "bound_ratio", "key") if k in after}
    if f.get("kind") == "in":
        # filed under the record's own module, as locate files an input finding (the gate matches
        # it to that row of this run's diff.csv); the code that computed it is its caller
        f["made_in"], f["module"] = f["module"], RecordKey.parse(f["key"]).module
    # confirm_label: its label in the rerun's own diff.csv (`--tp 1,2,2` confirms "2-2" as "2")
    entry.setdefault("findings", []).append({**f, "from": f"confirmation ({fix})", "confirm_label": sub_label})


def _round(cfg: CompareConfig, out: str, fixes, baseline: bool, on_status=None, finish: bool = True):
    """One round of the fix chain, judged as a plain compare is: its second pass (the float64
    verdicts, each module on its own inputs) where the compare wants one, then its classes.
    Its manifest gets its status after the second pass (finish=False: round 0, the session's own
    run directory, which the session finishes). Returns (summary, its RunFiles)."""
    summary, files = _rerun(cfg, out, cfg.degrees, fixes, baseline=baseline, finish=False)
    rcfg = cfg.with_(out=out, fixes=tuple(fixes), fix_mode="explicit", confirm=False, baseline=baseline)
    summary = _drilled(rcfg, summary, files, out, on_status)
    if finish:
        files.add(status=summary["status"])
    return summary, files


def final_class(chain: list[dict]) -> str | None:
    """The verdict of a fix chain: a bug or non-finite result of any round; else the last round's
    class where it still diverges (an `unknown` left over is not rounding); else - every
    difference removed by fixes that only reorder - rounding, or nothing when round 0 was bitwise."""
    for c in ("bug", "non-finite"):
        if any(r.get("class") == c for r in chain):
            return c
    if not chain:
        return None
    last = chain[-1]
    if last["status"] == "divergent":
        return last.get("class") or "unknown"
    if last["status"] == "bitwise":
        return "rounding" if len(chain) > 1 else None
    return last.get("class")


def auto_chain(cfg: CompareConfig, run_dir: str, on_status=None, max_rounds: int = 6):
    """Apply fixes for the located causes until bitwise or no fix applies; returns the last
    round's summary with `fix_chain` (one entry per round) attached, and round 0's RunFiles: the
    run the user asked for, whose files the session completes."""
    from tpdiag.fixes import groups
    from tpdiag.fixes.registry import catalogue, fixes_for_cause

    cfg = groups.resolve(cfg)
    fixes: list[str] = list(cfg.fixes)
    chain = []
    summary = None
    for i in range(max_rounds):
        if on_status:
            on_status("auto", f"round {i}: {', '.join(fixes) or 'stock'}")
        out = run_dir if i == 0 else RunDir(run_dir).fix_round(i)
        # round 0 is the run the user asked for (its summary is what compare prints): it gets the
        # reference rerun like any compare; the fixed rounds are compared with it, each marked with
        # its folder (it ran fixes the user did not choose)
        rcfg = cfg if i == 0 else _marked(cfg, run_dir, out)
        summary, files = _round(rcfg, out, fixes, cfg.baseline and i == 0, on_status, finish=i != 0)
        first = files if i == 0 else first
        from tpdiag.records.axes import entries

        firsts = {lab: (d.get("first_divergence") or {}) for lab, d in entries(summary).items()}
        chain.append({"round": i, "fixes": list(fixes), "status": summary["status"], "run_dir": out,
                      "class": summary.get("class"),
                      "first_divergence": {lab: ({"module": f.get("module"), "phase": f.get("phase"),
                                                  "kind": f.get("kind"), "cause": f.get("cause")}
                                                 if f else None) for lab, f in firsts.items()}})
        from tpdiag.records.judgeable import judgeable

        if summary["status"] != "divergent" and not (i == 0 and judgeable(summary)):
            break
        from tpdiag.diff.classes import leading_bug

        bugs = {lab: leading_bug(d) for lab, d in entries(summary).items()}
        bugs = {lab: {k: b.get(k) for k in ("phase", "module", "kind", "name", "cause", "bound_ratio")}
                for lab, b in bugs.items() if b}
        if bugs:
            chain[-1]["bug"] = bugs
        if summary.get("class") in ("bug", "non-finite"):
            # no fix removes a wrong result: the chain ends at it, and so does the verdict
            chain[-1]["stopped"] = f"a {'BUG' if summary['class'] == 'bug' else 'non-finite result'} (fix the code)"
            break
        new = []
        for f in firsts.values():
            for fx in (fixes_for_cause(f.get("cause", ""), f.get("op")) if f else ()):
                if fx not in fixes and fx not in new and catalogue()[fx].install is not None:
                    new.append(fx)
        if not new:
            chain[-1]["stopped"] = "no available fix for the remaining causes"
            break
        fixes += new
        failed = [lab for lab, d in entries(summary).items() if d.get("status") == "failed"]
        if i == 0 and failed:
            # a configuration whose world failed in round 0 is left out of the fixed rounds, which judge
            # the others as if it had not been asked for (round 0, the run, stays inconclusive)
            cfg = cfg.with_(only=tuple(lab for lab in entries(summary) if lab not in failed))
            chain[-1]["left_out"] = failed
    summary["fix_chain"] = chain
    return summary, first
