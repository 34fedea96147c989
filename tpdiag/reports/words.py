"""Plain-language verdicts: what differs, why, and what the user can do about it."""
from __future__ import annotations

from tpdiag.records import causes  # what each cause means, and the advice without a fix

KIND_WORDS = {"out": "output", "in": "input", "grad_out": "output gradient", "param_grad": "weight gradient",
              "param": "parameter after the optimizer step", "param_init": "initial parameter",
              "buffer": "buffer the step wrote",
              "logprobs": "logprobs", "loss": "loss", "grad_norm": "gradient norm", "batch": "batch"}


def fmt(x, spec: str = ".3g") -> str:
    if x is None or x == "":
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def where(fd: dict) -> str:
    what = KIND_WORDS.get(fd.get("kind"), fd.get("kind") or "record")
    name = fd.get("name")
    if name not in (None, "0", "total", fd.get("kind")):
        what += f" {name}"
    op = (f" (op {fd['op']}" + (f" at {fd['op_at']}" if fd.get("op_at") else "") + ")") if fd.get("op") else ""
    module = fd.get("module")
    if fd.get("kind") == "in" and fd.get("key"):
        from tpdiag.records.keys import RecordKey

        rec = RecordKey.parse(fd["key"]).module
        if rec != module:
            # a first divergence at an input is filed under the caller whose code computed it:
            # "the input of model" read as the model's own input (the tokens, bitwise equal)
            module = f"{rec}, computed in {module}'s own forward code"
    return f"the {what} of {module}{op} in the {fd.get('phase')} pass of step {fd.get('step', 0)}"


def size_sentence(fd: dict) -> str:
    parts = [f"max |difference| {fmt(fd.get('max_abs'))}"]
    if fd.get("max_ulp") is not None:
        parts.append(f"{fmt(fd['max_ulp'])} ULP")
    if fd.get("mismatch_fraction") is not None:
        parts.append(f"{100 * fd['mismatch_fraction']:.1f}% of elements differ")
    s = ", ".join(parts) + "."
    bound, mabs = fd.get("bound"), fd.get("max_abs")
    v = fd.get("oracle") or fd.get("op_oracle")
    if v:
        what = "module" if fd.get("oracle") else "op"
        s += (f" Re-executed in float64, the {what} is {v['err']:.3g} from this side and {v['ref_err']:.3g} "
              f"from the reference ({'relative ' if v.get('relative') else ''}2-norm; rounding allows "
              f"{v['threshold']:.3g}): ")
        s += ("far beyond rounding - a wrong result, not a reordering." if v["far"] and not v.get("discrete")
              else "both sides near it - a reordering, not a wrong result." if not v["far"]
              else "far, but it makes a discrete choice that rounding can flip.")
        return s
    if bound and mabs is not None:
        ratio = mabs / bound
        if ratio <= 1:
            s += (f" That is {100 * ratio:.2g}% of the rounding bound {fmt(bound)} of a reordered sum:"
                  " a different summation order, not a wrong result.")
        else:
            s += f" That is {ratio:.3g}x the rounding bound {fmt(bound)}: a wrong result, not a reordering."
    else:
        s += " No rounding bound is computed for this kind of record."
    return s


CAPTURE_FIX = ("then turn the fixes on in your own loop: `with tpdiag.invariant(model, plan, "
               "fixes=\"all\", tree_groups=G):` around it (docs/training.md), and capture again")
# the switch cannot reach torch's own clip: a loop under tpdiag.invariant that clips with it still
# sums the norm's shards in the TP layout's order (tests/test_user_inv_clip.py: every grad bitwise,
# the grad norm 2 ULP off; bitwise with tpdiag.clip_grad_norm_)
CAPTURE_CLIP = ("`tpdiag.invariant` leaves torch's own `clip_grad_norm_` as it is - clip with "
                "`tpdiag.clip_grad_norm_` (docs/training.md)")


def action(cause: str, confirmation: dict | None, fix: str | None, fix_available: bool,
           capture: bool = False) -> str:
    if confirmation and confirmation.get("fix"):
        v = confirmation.get("verdict")
        after = confirmation.get("first_divergence_after")
        if v == "confirmed":
            s = (f"fix {confirmation['fix']} -> confirmed: with it this record becomes bitwise equal"
                 # the record and its cause, as the terminal's `fix ... -> confirmed` line names them
                 # (it read "moves to model (loss)" where the terminal said "loss: logprobs
                 # (vocab-parallel-softmax)")
                 + (f"; the first divergence moves to {where(after)}"
                    + (f" ({after['cause']})." if after.get("cause") else ".")
                    if isinstance(after, dict) else " and nothing diverges any more."))
            return s
        if v == "not-confirmed":
            return (f"fix {confirmation['fix']} -> not-confirmed: it did not make this record bitwise equal, "
                    "so the cause label may be wrong.")
    advice = causes.REGISTRY[cause].action if cause in causes.REGISTRY else None
    if advice:
        return advice
    if fix:
        avail = "" if fix_available else " (not implemented in this build yet)"
        how = (f"{CAPTURE_FIX} ({fix} removes this cause{avail}"
               + (f"; {CAPTURE_CLIP}" if cause == "grad-norm" else "") + ")" if capture
               else f"then rerun with `--fix {fix}`{avail}")
        return (f"Rounding, not a bug: harmless unless you need bitwise equality with the reference; "
                f"{how}. To accept it in CI, put \"{cause}\" in "
                "`allow_causes` of a `tpdiag gate` policy.")
    return "No fix in the catalogue removes this cause."


def verdict(label: str, ref: str, d: dict, fix_of, capture: bool = False) -> dict:
    """One degree's verdict: {"status", "headline", "why", "size", "action", "findings"}."""
    st = d.get("status")
    if st == "failed":
        why = d.get("error", "no error recorded")
        return {"status": "failed", "headline": f"TP={label} could not be compared: {why}",
                "why": "", "size": "", "action": "Fix the failure and rerun; nothing is concluded for this degree.",
                "findings": []}
    fd = d.get("first_divergence")
    left = _not_compared(d)
    if st == "bitwise" or not fd:
        return {"status": st or "unknown",
                "headline": f"TP={label} is bitwise equal to TP={ref} in every {'compared ' if left else ''}record.",
                "why": "", "size": "", "action": "", "findings": left}
    cause = fd.get("cause") or "unknown"
    fix, available = fix_of(cause, fd.get("op"))
    detail = fd.get("detail") or ""
    why = f"Cause: {cause} - {fd.get('why') if cause == 'unknown' and fd.get('why') else causes.get(cause).why}."
    if detail:
        why += f" {detail[:1].upper()}{detail[1:]}."
    from tpdiag.diff.classes import roots

    # listed: the findings no other explains, by the rule the class and the gate group by
    first = roots(d.get("findings") or [], fd)
    findings = [f"{f.get('phase')} {f.get('module')} ({KIND_WORDS.get(f.get('kind'), f.get('kind'))}): "
                f"{f.get('cause')}, max |difference| {fmt(f.get('max_abs'))}"
                + (f" > bound {fmt(f.get('bound'))}" if f.get("bound") else "")
                + (f" ({f['detail']})" if f.get("partial_sum") else "")
                # the CLI's BUG line gives its reason (one factor, the float64 distance): so does the report
                + (f": {f['why']}" if f.get("why") and causes.cause_class(f.get("cause")) == "bug"
                   and not f.get("partial_sum") else "")
                for f in first]
    follows = len(d.get("findings") or []) - len(first)
    if follows:
        findings.append(f"{follows} more record{'s' if follows != 1 else ''} beyond rounding follow"
                        f"{'s' if follows == 1 else ''} from the findings above (their inputs already differed)")
    findings += _not_compared(d) + _not_judged(d)
    kind = {"bug": "BUG: ", "non-finite": "NON-FINITE: ", "rounding": "Rounding: "}.get(d.get("class"), "")
    headline = f"{kind}TP={label} first differs from TP={ref} at {where(fd)}."
    bug = _bug_behind(d, fd)
    if bug is not None:
        # the verdict names where the wrong result is, as the CLI's first line does: the first
        # divergence here is a harmless reordering before it
        headline = (f"{kind}TP={label} computes a wrong result at {where(bug)} ({bug.get('cause')}); it first "
                    f"differs from TP={ref} earlier, at {where(fd)} ({cause}: "
                    f"{'rounding' if causes.cause_class(cause) == 'rounding' else 'not judged'}).")
    todo = action(cause, d.get("confirmation"), fix, available, capture)
    if d.get("class") == "unknown" and causes.cause_class(cause) == "rounding":
        # rounding at the first divergence, but what lies past it was not judged (diff/classes.py): the
        # gate fails the run as cause unknown, so the report does not call it harmless
        from tpdiag.diff.moved_limit import moved_beyond
        from tpdiag.diff.not_judged_words import grads_kind

        nj = d.get("not_judged") if isinstance(d.get("not_judged"), dict) else {}
        todo = ("Not judged: " + (f"{grads_kind(nj)} past the first divergence moved beyond rounding and no "
                                  "check could judge them (below)" if moved_beyond(d) else
                                  f"the modules past the first divergence were not judged on their own inputs "
                                  f"({d.get('downstream_unjudged') or 'see the run'})")
                + "; a bug may be there unseen. `tpdiag gate` fails the run unless its policy allows `unknown`.")
    if bug is not None:
        # the first divergence's own advice ("Rounding, not a bug: harmless ...") is about the
        # reordering before the bug; the CLI's `what to do` is about the bug, and so is this
        todo = (f"Fix the code at the wrong result ({where(bug)}): no kernel fix removes it. The first "
                f"divergence before it ({cause}) is rounding, and no gate policy passes the wrong result.")
    return {"status": st, "headline": headline,
            "why": why, "size": size_sentence(fd), "action": todo,
            "findings": findings}


def _not_compared(d: dict) -> list[str]:
    """The records this degree left uncompared (summary.json not_compared), in one line: evidence
    neither way, so the report says they exist."""
    nc = d.get("not_compared") or {}
    if not nc.get("records"):
        return []
    keys = nc.get("module_records") or []
    more = nc.get("module_records_more", 0)
    return [f"Not compared: {nc['records']} record{'s' if nc['records'] != 1 else ''} ("
            + ", ".join(f"{w} {n}" for w, n in (nc.get("why") or {}).items()) + ")"
            + (f"; module records among them: {', '.join(keys)}{f' and {more} more' if more else ''}" if keys else "")
            + " - their values are evidence neither way."]


def _not_judged(d: dict) -> list[str]:
    """The grads past the first divergence that no check judged (summary.json not_judged,
    diff/not_judged.py), in one line, as the CLI says them."""
    nj = d.get("not_judged") or {}
    if not nj.get("records"):
        return []
    keys = nj.get("keys") or []
    more = nj["records"] - len(keys)
    from tpdiag.diff.not_judged_words import grads_words

    return [f"Not judged past the first divergence: {grads_words(nj)}"
            f"{moved_by(nj)}: {not_judged_keys(nj, len(keys))}{f' and {more} more' if more > 0 else ''}"
            " - no exact value to judge them against, so neither rounding nor a bug is shown for them."]


def not_judged_keys(nj: dict, n: int) -> str:
    """The first n keys of summary.json not_judged, each with its own reason (`reasons`) - a weight's
    grad named as one: `KEY (weight grad of NAME: reason)`; a run before those were kept: the keys,
    then every reason once."""
    from tpdiag.diff.not_judged_words import grad_words

    keys = [k for k in (nj.get("keys") or [])[:n] if isinstance(k, str)]
    reasons = nj.get("reasons") if isinstance(nj.get("reasons"), dict) else None
    if reasons is None:
        return f"{', '.join(keys)} ({'; '.join(nj.get('why') or {})})"

    def one(k: str) -> str:
        w = grad_words(k)
        w = w if w.startswith("weight grad") else ""
        if reasons.get(k):
            return f"{k} ({w}: {reasons[k]})" if w else f"{k} ({reasons[k]})"
        return f"{k} ({w})" if w else k

    return "; ".join(one(k) for k in keys)


def _bug_behind(d: dict, fd: dict) -> dict | None:
    """The first root bug-class finding of a degree whose own first divergence is rounding (a bug
    behind a harmless reordering); None otherwise."""
    if d.get("class") != "bug" or causes.cause_class(fd.get("cause")) == "bug":
        return None
    from tpdiag.diff.classes import roots

    return next((f for f in roots([g for g in d.get("findings") or () if isinstance(g, dict)], fd)
                 if causes.cause_class(f.get("cause")) == "bug"), None)


def moved_by(nj: dict) -> str:
    """How far the unjudged grads moved as a whole (summary.json not_judged.rel_l2; older runs
    lack it and say nothing): the elementwise max_rel is no size - a reference element near zero
    makes it any number."""
    rel = nj.get("rel_l2")
    return f", up to {rel:.3g} of the reference's norm" if isinstance(rel, (int, float)) else ""


def not_carried_line(nc: dict) -> str:
    """Weights the fixes' fp32 carry left the stock grad (summary.json not_carried: use -> why), in
    one line: the fixes' "bitwise across TP" does not cover them (kernels/grad_carry.site)."""
    names = sorted(nc)
    whys = sorted(set(nc.values()))
    more = len(names) - 3
    return (f"with the fixes on, {len(names)} weight use{'s' if len(names) != 1 else ''} kept the stock grad "
            f"({'; '.join(whys)}), which no fix makes TP-invariant - a difference there is not removed by "
            f"the fixes: {', '.join(names[:3])}{f' and {more} more' if more > 0 else ''}")
