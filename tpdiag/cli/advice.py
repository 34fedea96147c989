"""The lines after compare's tables that tell the user what to do: the advice for the run's
class, and the axis combinations a one-axis-at-a-time run did not look at."""
from __future__ import annotations

import os

from tpdiag.base.points import config_name


def not_run_line(summary: dict) -> str | None:
    """Names the combinations a one-axis-at-a-time run left out, so no verdict reads as covering them."""
    from tpdiag.records.axes import combination_name, not_run

    missing = not_run(summary)
    if not missing:
        return None
    ref = summary.get("reference_config") or {}
    names = ", ".join(combination_name(c, ref) for c in missing)
    return (f"not run: {names} (the axes were compared one at a time; `--grid` runs every "
            "combination - a mistake that shows only there is in none of the configurations above)")


def what_to_do(summary: dict) -> str | None:
    todo = _what_to_do(summary)
    if todo and todo.startswith("nothing is wrong") and not_run_line(summary):
        # rounding holds for what ran: the combinations left out were not looked at
        todo = "nothing is wrong in the configurations that ran" + todo[len("nothing is wrong"):] + \
            "; the combinations not run (above) were not checked: `--grid` runs them"
    return todo


def _ran_with_its_fix(summary: dict, confirmations: list) -> list[str]:
    """Without confirmations (--no-confirm): the fixes every divergent degree's cause names, where
    the run already had each of them on (empty otherwise) - `--fix auto` would add nothing."""
    if not confirmations or any(confirmations):
        return []
    from tpdiag.fixes.registry import fix_for_cause
    from tpdiag.records.axes import entries

    on = set(summary.get("fixes") or ())
    firsts = [d.get("first_divergence") or {} for d in entries(summary).values() if d.get("status") == "divergent"]
    need = {fix_for_cause(fd.get("cause") or "", fd.get("op")) for fd in firsts}
    return sorted(need) if on and firsts and None not in need and need <= on else []


def _no_fix_for(summary: dict) -> list[str]:
    """The causes of the divergent degrees where no fix in the catalogue removes any of them (their
    confirmation says so, or, unconfirmed, the registry has none): `--fix auto` has nothing to run.
    Empty where some degree's cause has a fix."""
    from tpdiag.fixes.registry import fixes_for_cause
    from tpdiag.records.axes import entries

    causes = []
    for d in entries(summary).values():
        if not isinstance(d, dict) or d.get("status") != "divergent":
            continue
        fd, conf = d.get("first_divergence") or {}, d.get("confirmation")
        if isinstance(conf, dict):
            if conf.get("verdict") != "no-fix" or conf.get("fix"):
                return []
        elif not fd.get("cause") or fixes_for_cause(fd["cause"], fd.get("op")):
            return []
        causes.append(fd.get("cause") or "?")
    return sorted(set(causes))


def _in_unprobed_code(summary: dict) -> bool:
    """An unjudged first divergence at a module's input whose difference arose in its caller's own code."""
    from tpdiag.records.axes import entries

    return any(d.get("status") == "divergent" and (d.get("first_divergence") or {}).get("cause") == "unknown"
               and str((d.get("first_divergence") or {}).get("why") or "").endswith("no op there was recorded")
               for d in entries(summary).values())


def _unjudged_capture(summary: dict) -> str | None:
    from tpdiag.records.axes import entries

    return next((d["unjudged_capture"]["why"] for d in entries(summary).values()
                 if isinstance(d, dict) and isinstance(d.get("unjudged_capture"), dict)
                 and d["unjudged_capture"].get("why")), None)


def _stock_grad(summary: dict) -> tuple[str, str] | None:
    """(the weight - module.name - of a divergent degree's first divergence, a weight grad, that the
    fixes' carry left the stock grad, and why: summary.json not_carried), else None."""
    from tpdiag.records.axes import entries

    for d in entries(summary).values():
        fd = (d or {}).get("first_divergence") or {} if isinstance(d, dict) else {}
        weight = f"{fd.get('module')}.{fd.get('name')}"
        if fd.get("kind") == "param_grad" and weight in (d.get("not_carried") or {}):
            return weight, d["not_carried"][weight]
    return None


def _fix_left_it(summary: dict) -> list[str]:
    """The fixes whose confirmation left every divergent degree's first divergence on the same
    record (not-confirmed, nothing moved); empty where any degree has no such confirmation."""
    from tpdiag.records.axes import entries

    fixes = set()
    for d in entries(summary).values():
        if not isinstance(d, dict) or d.get("status") != "divergent":
            continue
        c, key = d.get("confirmation") or {}, (d.get("first_divergence") or {}).get("key")
        if c.get("verdict") != "not-confirmed" or not c.get("fix") or not key \
                or (c.get("first_divergence_after") or {}).get("key") != key:
            return []
        fixes.add(c["fix"])
    return sorted(fixes)


def _failed_worlds(summary: dict) -> str | None:
    """What to do where a configuration's world failed (the run inconclusive), else None: its error
    is in the table, its ranks' tracebacks in its folder - a new user's TP=16 of a 4-head model read
    only `verdict: inconclusive` and the error, with no next step."""
    from tpdiag.records.axes import entries
    from tpdiag.records.paths import RunDir

    failed = [(lab, d) for lab, d in entries(summary).items() if isinstance(d, dict) and d.get("status") == "failed"]
    if summary.get("status") != "inconclusive" or not failed:
        return None
    run = summary.get("run_dir") or "RUN_DIR"
    names = ", ".join(f"TP={lab}" if d.get("axis") == "tp" else str(lab) for lab, d in failed)
    one = len(failed) == 1
    return (f"{names} failed, so nothing was compared there: fix what {'its' if one else 'each'} error in the table "
            "says (a crash in the model's code, a shape the degree cannot split) or leave "
            f"{'that configuration' if one else 'those configurations'} out, then run again; each rank's traceback "
            f"is in {os.path.join(RunDir(run).world(failed[0][0]), 'rank*.error')}"
            + (" (the others' likewise)" if not one else ""))


def _unknown_past_first(summary: dict) -> bool:
    """Some configuration's first divergence has a cause and a root finding past it has none."""
    from tpdiag.diff.classes import roots
    from tpdiag.records.axes import entries

    return any(isinstance(d, dict) and (d.get("first_divergence") or {}).get("cause") not in (None, "unknown")
               and any(f.get("cause") == "unknown" for f in roots(d.get("findings") or []))
               for d in entries(summary).values())


def _what_to_do(summary: dict) -> str | None:
    failed = _failed_worlds(summary)
    if failed:
        return failed
    c = summary.get("class")
    if summary.get("status") != "divergent" or not c:
        return None
    run = summary.get("run_dir") or "RUN_DIR"
    if c == "bug":
        return (f"fix the model code at the BUG above (a wrong result that no kernel fix removes); "
                f"`tpdiag report {run}` shows its values against the reference")
    if c == "non-finite":
        return "find where the NaN/Inf first appears (the finding above); no fix or policy hides it"
    if c == "unknown":
        if summary.get("fix_chain"):
            return ("the fixes did not remove every difference and nothing could judge what is left "
                    f"(the last fix chain round above); `tpdiag report {run}` shows the values")
        unjudged = _unjudged_capture(summary)
        if unjudged:
            # the reference capture re-executed nothing in float64 there: the call that judges it
            return unjudged + f"; `tpdiag report {run}` shows its values"
        if summary.get("source") == "capture" and _in_unprobed_code(summary):
            # a capture records module boundaries only: the user's next step is to give that code
            # a boundary, or to let compare's second pass record it op by op
            return ("the first divergence arises in a module's own forward code between the modules it "
                    "calls, where a capture records nothing: move that code into a submodule of its own "
                    "(its output is then recorded, which locates the difference) and capture again, or run the model with "
                    "`tpdiag compare --model py:FILE.py:FUNC` (docs/models-py.md), whose second pass records "
                    f"and judges that code op by op; `tpdiag report {run}` shows its values")
        from tpdiag.diff.moved_limit import moved_beyond
        from tpdiag.diff.not_judged_words import grads_kind
        from tpdiag.records.axes import entries

        beyond = [d for d in entries(summary).values() if isinstance(d, dict) and moved_beyond(d)]
        if beyond:
            # the gate fails the run on them (cause unknown): not "nothing is wrong"
            kinds = {grads_kind(d["not_judged"]) for d in beyond}
            what = kinds.pop() if len(kinds) == 1 else "grads"
            return (f"{what} past the first divergence moved beyond rounding and no check could judge "
                    "them (the not-judged line above, summary.json not_judged): a bug may be there unseen; "
                    f"`tpdiag report {run}` shows their values, and `tpdiag gate` fails the run unless its policy "
                    "allows `unknown`")
        if _unknown_past_first(summary):
            # the first divergence was judged; a record past it was not (a far float64 verdict with
            # a choice inside that may have flipped: diff/judge.py FLIP_UNSHOWN)
            return ("a record past the first divergence could not be judged (the `unknown` finding above): a "
                    f"bug may be there unseen; `tpdiag report {run}` shows its values, and `tpdiag gate` fails "
                    "the run unless its policy allows `unknown`")
        return ("nothing could judge the first divergence (the reason is above); "
                f"`tpdiag report {run}` shows its values")
    if summary.get("fix_chain") and summary.get("status_after_fixes") == "bitwise":
        fixes = ",".join(summary["fix_chain"][-1].get("fixes") or [])
        # what to type in the user's own loop, not only that the fixes exist (README: Train with the fixes on)
        keep = (f"; to train with them on, wrap your loop in `with tpdiag.invariant(model, plan, fixes=\"{fixes}\", "
                "tree_groups=G):` with G the largest TP degree you compare, the same at every degree"
                if fixes else "")
        return ("nothing is wrong: the fixes of the chain above remove every difference (they only "
                "reorder computations); keep them on where you need bitwise equality" + keep)
    if summary.get("fix_chain"):
        return ("nothing is wrong: what is left after the fix chain above is rounding only (judged in its "
                "last round); no available fix removes the rest")
    from tpdiag.records.axes import entries

    if summary.get("source") == "capture":
        # a capture's model is the user's own loop: `compare --fix` cannot run it
        from tpdiag.reports.words import CAPTURE_FIX

        s = ("nothing is wrong: the captures differ by rounding only. Harmless unless you need "
             f"bitwise equality across TP; {CAPTURE_FIX}")
        firsts = [d.get("first_divergence") or {} for d in entries(summary).values() if d.get("status") == "divergent"]
        if any(fd.get("cause") == "grad-norm" for fd in firsts):
            from tpdiag.reports.words import CAPTURE_CLIP

            s += f"; the first difference is the grad norm: {CAPTURE_CLIP}"
        return s
    confirmations = [d.get("confirmation") or {} for d in entries(summary).values()
                     if d.get("status") == "divergent"]
    # said only where it holds of every divergent degree: one whose cause's fix was off is one
    # `--fix auto` can still make bitwise
    on = _ran_with_its_fix(summary, confirmations)
    if on or confirmations and all(str(c.get("reason", "")).endswith("was already on") for c in confirmations):
        on = on or sorted({c["fix"] for c in confirmations if c.get("fix")})
        kept = _stock_grad(summary)
        if kept:
            kept, why = kept
            # the carry left that weight the stock grad (kernels/grad_carry.site): no fix reaches it
            return (f"nothing is wrong: the difference is rounding only. The fixes ({', '.join(on)}) were on, but "
                    f"{kept} kept the stock grad ({why}), which no fix makes "
                    "TP-invariant, so `--fix auto` would not remove it either")
        # --fix auto reruns with the fixes the cause names: they were on, so it would change nothing
        return (f"nothing is wrong: the difference is rounding only. Its cause's fix ({', '.join(on)}) was "
                "already on and did not remove it: this module is not one the fix covers (docs/models.md), "
                "so `--fix auto` would not remove it either")
    unfixable = _no_fix_for(summary)
    if unfixable:
        # every divergent degree's cause has no fix (the confirmation line above says "no fix to
        # confirm it with"): offering `--fix auto` there contradicted it, and it would change nothing
        return (f"nothing is wrong: the difference is rounding only. No fix removes its cause "
                f"({', '.join(unfixable)}), so `--fix auto` would not remove it either (docs/causes.md)")
    stuck = _fix_left_it(summary)
    if stuck:
        # its cause's fix ran and left that very record as it was: --fix auto would rerun the same
        return (f"nothing is wrong: the difference is rounding only. Its cause's fix ({', '.join(stuck)}) did "
                "not remove it (the confirmation above: the first divergence stayed where it was), so "
                "`--fix auto` would not remove it either")
    if all(config_name(lab) == f"TP={lab}" for lab in entries(summary)):
        return ("nothing is wrong: the degrees differ by rounding only. Harmless unless you need "
                "bitwise equality across TP; then `tpdiag compare --fix auto` applies the fixes that remove it")
    return ("nothing is wrong: the configurations differ by rounding only. Harmless unless you need "
            "bitwise equality across them; then `tpdiag compare --fix auto` applies the fixes that remove "
            "what they cover (docs/micro-batch.md and docs/decode.md say what they do not)")
