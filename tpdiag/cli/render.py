"""Rich rendering of a run's verdict for the CLI: the tables, the finding lines, the text form (the live
status is progress.py; the other tables tables.py)."""
from __future__ import annotations

from tpdiag.base.points import config_name
from tpdiag.cli.plain_table import _box, _fmt, _print_table
from tpdiag.cli.record_words import _chain_at, made_by, where
from tpdiag.reports.words import moved_by, not_judged_keys


def ran(summary: dict) -> str | None:
    steps = summary.get("steps")
    if steps is None:
        return None
    what = "forward, backward and optimizer step" if summary.get("backward", True) else "forward only"
    line = f"ran: {steps} step{'s' if steps != 1 else ''} at each degree ({what})"
    if summary.get("anchor") is True:
        refused = {lab: d["anchor_refused"] for lab, d in (summary.get("degrees") or {}).items()
                   if isinstance(d, dict) and isinstance(d.get("anchor_refused"), dict)}
        line += "; each later step from the reference's state (--anchor, the default)"
        for lab, r in refused.items():
            # the world loaded nothing from that step on: its later steps are the drifted ones
            line += (f"; {config_name(lab)} refused it from step {r.get('step')} ({r.get('why')}): those steps from "
                     "its own weights")
    elif summary.get("anchor") is False and summary.get("backward", True):
        # without it a later step's records move by the updates' drift too, judged by magnitude only
        line += ("; later steps from each side's own weights (--no-anchor; `--anchor`, the default, judges them "
                 "from the reference's state)")
    sl = summary.get("slice")
    if isinstance(sl, dict) and sl.get("what"):
        line += f"; model: {sl['what']} (--layers {sl.get('layers')})"
    decode = [lab for lab, c in (summary.get("configurations") or {}).items()
              if (c.get("config") or {}).get("mode") == "decode"]
    if decode and summary.get("backward", True):
        line += f"; {', '.join(decode)}: forward only (decode has no backward)"
    if summary.get("fixes"):
        line += f"; fixes: {', '.join(summary['fixes'])}"
        if summary.get("tree_groups"):
            from tpdiag.fixes.groups import describe

            line += f"; {describe(summary['tree_groups'], summary.get('group_gemm'))}"
    return line


def summary_tables(console, summary: dict, baseline_skipped: str | None = None) -> None:
    """baseline_skipped: why compare did not rerun the reference (its line says so)."""
    from rich import box
    from rich.table import Table

    # Every string of the run (module names of a py: model, paths, error texts) prints as text: a module
    # named `w[/]x` was read as rich markup and the whole verdict was lost to a MarkupError (exit 2).
    # The lines printed with markup=False take the raw summary.
    raw, summary = summary, _as_text(summary)

    status = summary["status"]
    color = {"bitwise": "green", "divergent": "yellow", "inconclusive": "red"}.get(status, "white")
    console.print(f"[bold]verdict:[/] [{color}]{status}[/]{_class_words(summary)}{_bug_words(summary)} "
                  f"(reference {config_name(summary['reference_label'])})")
    base = summary.get("baseline")
    if ran(summary):
        console.print(ran(summary))
    if (summary.get("flags") or {}).get("line"):
        console.print(raw["flags"]["line"], markup=False, soft_wrap=True)
    if (summary.get("logprob_recipe") or {}).get("formula"):
        console.print(f"logprob recipe (--logprob): {raw['logprob_recipe']['formula']}, in every configuration",
                      markup=False, soft_wrap=True)
    if (summary.get("checkpoint_dtype") or {}).get("note"):
        console.print(f"note: {raw['checkpoint_dtype']['note']}", markup=False, soft_wrap=True)
    if base is not None and base.get("reproducible") is None:  # the rerun failed: nothing was checked
        console.print("baseline: [red]the reference rerun failed[/]; reproducibility not checked")
    elif base is not None:
        console.print("baseline: reference rerun is " + ("[green]bitwise reproducible[/]" if base["reproducible"]
                      else f"[red]NOT reproducible[/] ({base.get('cause')})"))
    elif baseline_skipped:
        console.print(f"baseline: reference not rerun against itself ({baseline_skipped})")
    t = Table(show_lines=False, pad_edge=False, box=_box(console, box.HEAVY_HEAD))
    from tpdiag.records.axes import entries

    plain = all(config_name(lab) == f"TP={lab}" for lab in entries(summary))
    t.add_column("TP" if plain else "config", no_wrap=True)
    t.add_column("status", no_wrap=True)
    from tpdiag.diff.classes import leading_bug

    bugs = any(leading_bug(d) for d in entries(summary).values())
    t.add_column("first bug, else first divergence" if bugs else "first divergence", overflow="fold", min_width=30)
    t.add_column("cause", overflow="fold", min_width=22)
    t.add_column("max abs / bound", no_wrap=True)
    t.add_column("ULP", no_wrap=True)
    t.add_column("logprob err", no_wrap=True)
    for label, d in entries(summary).items():
        if d["status"] == "failed":
            t.add_row(label, "[red]failed[/]", d.get("error", ""), "-", "-", "-", "-")
            continue
        from tpdiag.diff.classes import leading_bug

        # a bug leads the row; the first (harmless) divergence is named on a line below
        lead = leading_bug(d)
        fd = lead or d.get("first_divergence") or {}
        lp = d.get("logprobs") or {}
        st = "[green]bitwise[/]" if d["status"] == "bitwise" else "[yellow]divergent[/]"
        if lead:  # the bug may be the first divergence itself: the row says BUG either way
            from tpdiag.records.causes import cause_class

            st = "[bold red]NON-FINITE[/]" if cause_class(lead.get("cause")) == "non-finite" else "[bold red]BUG[/]"
        err = f"{_fmt(fd.get('max_abs'))} / {_bound_cell(fd)}" if fd else "-"
        if fd.get("cause") == "rank-inconsistent-replica":  # its ranks' spread, not a value vs the reference
            err = f"{_fmt(fd.get('rank_max_abs', fd.get('max_abs')))} between ranks"
        if fd.get("cause") == "non-finite":  # no size to compare with a bound: say what it is
            err = _nonfinite_where(d, label)
        lperr = (f"{_fmt(lp.get('max_abs'))} (x{lp['token_mult_prob_error']:.7f})"
                 if lp.get("max_abs") is not None else "-")
        t.add_row(label, st, where(fd, at_bug=True) if fd else "-", fd.get("cause", "-"), err, _fmt(fd.get("max_ulp")),
                  lperr)
    _print_table(console, t)
    for label, d in entries(summary).items():
        fd = d.get("first_divergence") or {}
        from tpdiag.diff.classes import leading_bug

        lead = leading_bug(d)
        if fd and lead not in (None, fd):
            console.print(f"{config_name(label)}: first divergence (before the bug, {fd.get('cause')}): {where(fd)}")
            if lead.get("oracle") or lead.get("op_oracle"):
                # the bug's own float64 verdict (what it was held against, where its error sits),
                # as when it is the first divergence: behind a rounding difference (a GPU's
                # vocab-parallel softmax) it read as a bare finding
                console.print(f"{config_name(label)}: {oracle_line(lead)}")
                # a cast's precision loss (diff/bits.narrowed_to), one factor times the reference's (diff/scale.py)
                if (lead.get("narrowed") or lead.get("far_scale") is not None) and lead.get("why"):
                    console.print(f"{config_name(label)}: cause {lead['cause']}: {lead['why']}", markup=False,
                                  soft_wrap=True)
            elif lead.get("why"):
                console.print(f"{config_name(label)}: BUG at {where(lead)}: {lead['why']}", markup=False,
                              soft_wrap=True)
        if fd.get("oracle") or fd.get("op_oracle"):
            console.print(f"{config_name(label)}: {oracle_line(fd)}")
        if fd.get("why"):
            console.print(f"{config_name(label)}: cause {fd['cause']}: {fd['why']}")
        _findings(console, label, d, fd)
        opt = next((f for f in d.get("findings") or () if isinstance(f, dict) and f.get("optimizer_step")
                    and f.get("cause") == "unknown" and "follows" not in f and f.get("why")), None)
        if opt is not None:  # a parameter after the user's own step that no check bounds: why, what to do
            console.print(f"{config_name(label)}: not judged at {where(opt)}: {opt['why']}", markup=False,
                          soft_wrap=True)
        pieces = list((d.get("per_piece") or {}).items())
        if pieces:  # one line for every experts module (a deep MoE has one per layer)
            names = ", ".join(b for b, _ in pieces[:2]) + (f" and {len(pieces) - 2} more" if len(pieces) > 2 else "")
            console.print(f"{config_name(label)}: {names}: {pieces[0][1].get('why')}", markup=False, soft_wrap=True)
        for block, pr in (d.get("per_rank") or {}).items():
            console.print(f"{config_name(label)}: {block}: {pr.get('why')}", markup=False, soft_wrap=True)
            for key in ("not_the_reference", "weights_unchecked"):
                if pr.get(key):
                    console.print(f"{config_name(label)}: {block}: {pr[key]}", markup=False, soft_wrap=True)
        nc = d.get("not_compared") or {}
        if nc.get("module_records"):  # module records (not only ops) whose values are evidence neither way
            keys = nc["module_records"]
            more = len(keys) - 3 + nc.get("module_records_more", 0)
            console.print(f"{config_name(label)}: not compared ({', '.join(f'{k} {n}' for k, n in nc['why'].items())}): "
                          f"{', '.join(keys[:3])}{f' and {more} more' if more > 0 else ''} - summary.json not_compared",
                          markup=False, soft_wrap=True)
        nj = d.get("not_judged") or {}
        if nj.get("keys"):  # divergent grads past the first divergence that no check could judge
            more = nj["records"] - min(3, len(nj["keys"]))
            from tpdiag.diff.not_judged_words import grads_words

            console.print(f"{config_name(label)}: not judged past the first divergence ({grads_words(nj)}"
                          f"{moved_by(nj)}): {not_judged_keys(nj, 3)}"
                          f"{f' and {more} more' if more > 0 else ''} - summary.json not_judged",
                          markup=False, soft_wrap=True)
        from tpdiag.records.keys import param_name

        # both readings of a "model" record: the root's own parameter, or HF's `model` child's
        named = {n for g in d.get("findings") or [] if g.get("kind") == "param_grad"
                 for n in (param_name(str(g.get("module")), str(g.get("name"))), f"{g.get('module')}.{g.get('name')}")}
        quiet = [f"{p} ({', '.join(h)})" for p, h in sorted((d.get("hooks_dropped") or {}).items()) if p not in named]
        if quiet:  # dropped, but no finding: the hook changed no grad at the reference (diff/dropped_hooks.py)
            console.print(f"{config_name(label)}: the plan dropped the user's grad hooks on {'; '.join(quiet)}: they "
                          f"run at the reference only, where they changed no grad this run (an observer, or a clip "
                          f"that did not act), so no number shows it yet - summary.json hooks_dropped",
                          markup=False, soft_wrap=True)
        for of, nc in (("", d.get("not_carried")), (" of the confirmation", (d.get("confirmation") or {}).get("not_carried"))):
            if nc:
                from tpdiag.reports.words import not_carried_line

                console.print(f"{config_name(label)}: {not_carried_line(nc)}{of} - summary.json not_carried",
                              markup=False, soft_wrap=True)
        if d.get("downstream_unjudged"):
            console.print(f"{config_name(label)}: the divergent modules past the first divergence were not "
                          f"judged on their own inputs ({d['downstream_unjudged']}): not called rounding only")
        conf = d.get("confirmation")
        if conf:
            after = conf.get("first_divergence_after")
            if conf.get("fix") is None:
                from tpdiag.records.causes import cause_class

                console.print(f"{config_name(label)}: " + ("no fix applies to a bug (fix the code)"
                              if cause_class(fd.get("cause")) == "bug"
                              else f"no fix to confirm it with ({conf.get('reason', 'none applies')})"))
                continue
            console.print(f"{config_name(label)}: fix [bold]{conf.get('fix')}[/] -> {conf.get('verdict')}; "
                          + (f"first divergence moves to {where(after)} ({after['cause']})" if after
                             else "no divergence left" if conf.get("verdict") == "confirmed"
                             else conf.get("reason", ""))
                          + (f" (on positions 0..{conf['positions'][0] - 1} of {conf['positions'][1]}; "
                             f"`--fix {(conf.get('fix') or '').replace('+', ',')}` checks every position)" if conf.get("positions") else ""))
        if fd.get("positions"):
            console.print(f"{config_name(label)}: {_on_positions(fd['positions'])}")
    for rnd in summary.get("fix_chain") or []:
        firsts = ", ".join(f"{config_name(lab)}: {fd['cause']} at {_chain_at(fd)}" for lab, fd in
                           rnd["first_divergence"].items() if fd) or "-"
        cls = {"bug": ", BUG", "non-finite": ", NON-FINITE", "unknown": ", not judged",
               "rounding": ", rounding"}.get(rnd.get("class"), "")
        console.print(f"fix chain round {rnd['round']} ({', '.join(rnd['fixes']) or 'stock'}): "
                      f"{rnd['status']}{cls}; {firsts}" + (f" ({rnd['stopped']})" if rnd.get("stopped") else "")
                      + (f"; the next rounds leave out {', '.join(config_name(lab) for lab in rnd['left_out'])} (failed)"
                         if rnd.get("left_out") else ""))
    if summary.get("status_after_fixes"):
        console.print(f"[bold]after fixes:[/] {summary['status_after_fixes']}")
    if summary.get("error"):
        console.print(f"[red]{summary['error']}[/]")
    from tpdiag.cli.advice import not_run_line, what_to_do

    missing = not_run_line(summary)
    if missing:
        console.print(missing)
    todo = what_to_do(summary)
    if todo:
        console.print(f"[bold]what to do:[/] {todo}")
    if summary.get("run_dir"):
        console.print(f"run directory: {summary['run_dir']}  (tpdiag report {summary['run_dir']})")


def _as_text(v):
    """A copy of a summary with every string escaped for rich markup (keys too: labels print)."""
    from rich.markup import escape

    if isinstance(v, str):
        return escape(v)
    if isinstance(v, dict):
        return {(escape(k) if isinstance(k, str) else k): _as_text(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_as_text(x) for x in v]
    return v


def _nonfinite_where(d: dict, label: str) -> str:
    """'nan at TP=2 only' / 'nan at the reference only' / 'nan at the reference and TP=2'."""
    first = (d.get("nonfinite") or {}).get("first") or {}
    value, side = first.get("value", "nan or inf"), first.get("side", "degree")
    return {"reference": f"{value} at the reference only",
            "both": f"{value} at the reference and {config_name(label)}"}.get(side, f"{value} at {config_name(label)} only")


def _class_words(summary: dict) -> str:
    """The headline's bug-or-rounding part: ', BUG' / ', rounding only' / ', not judged'."""
    c = summary.get("class")
    if summary.get("status") != "divergent" or not c:
        return ""
    return {"bug": ", [bold red]BUG[/] (a wrong result, not rounding)",
            "non-finite": ", [bold red]NON-FINITE[/] (NaN or Inf: never rounding)",
            "rounding": ", rounding only", "unknown": ", not judged (cause unknown)"}[c]


def _bug_words(summary: dict) -> str:
    """Where the first bug is, on the verdict line: its record and how far beyond rounding."""
    if summary.get("class") not in ("bug", "non-finite"):
        return ""
    from tpdiag.diff.classes import leading_bug
    from tpdiag.records.axes import entries

    for label, d in entries(summary).items():
        b = leading_bug(d)
        if b:
            r = _bug_ratio(b)
            # summary.json writes an infinite ratio as the string "inf"
            r = r if isinstance(r, (int, float)) and not isinstance(r, bool) else None
            far = f", {r:.3g}x beyond rounding" if r and 1 < r < float("inf") else ""
            if b.get("cause") == "non-finite" and (d.get("nonfinite") or {}).get("first"):
                # which side holds it: NaN at the reference too is no degree's doing ("infx beyond
                # rounding" said nothing, and "at TP=2" read as TP=2's alone)
                far = f" - {_nonfinite_where(d, label)}"
            return f" at {config_name(label)} {where(b, at_bug=True)}{far}"
    for rnd in summary.get("fix_chain") or []:  # found only once fixes removed the reorderings
        for label, b in (rnd.get("bug") or {}).items():
            r = b.get("bound_ratio")
            far = f", {r:.3g}x beyond rounding" if r and r > 1 else ""
            return f" at {config_name(label)} {where(b)}{far} (fix chain round {rnd['round']})"
    return ""


def _bug_ratio(fd: dict):
    """How far beyond rounding a bug is: where its caller's float64 re-execution judged it (`bug_op`),
    that ratio - the first op's own (a reordering before the bug, within rounding) read "0.06x"."""
    bug = fd.get("bug_op") if fd.get("cause") == "sharding-bug" else None
    return bug["caller_ratio"] if bug else fd.get("bound_ratio")


def _bound_cell(fd: dict) -> str:
    if fd.get("bug_op") and fd.get("cause") == "sharding-bug":
        return f"{_bug_ratio(fd):.2g}x rounding"
    v = fd.get("oracle") or fd.get("op_oracle")
    if fd.get("bound") is None and v:
        # no bound in the record's units: the float64 verdict's ratio to what rounding allows
        return f"{v['ratio']:.2g}x rounding"
    return _fmt(fd.get("bound"))


def oracle_line(fd: dict) -> str:
    """The float64 verdict in words (diff/oracle.py)."""
    v = fd.get("oracle") or fd.get("op_oracle")
    what = v.get("what") or ("its op" if not fd.get("oracle") else
                             {"param_grad": "the module's backward", "grad_out": "its consumer's backward",
                              # a buffer's float64 value is the one its writer's forward left in it
                              "buffer": "the forward that wrote it"}.get(
                                 fd.get("kind"), "the module"))
    unit = "relative " if v.get("relative") else ""
    dist = (f"this side {v['err']:.2e} from it, the reference {v['ref_err']:.2e} ({unit}2-norm; "
            f"rounding allows {v['threshold']:.2e})")
    if v["far"] and not v.get("discrete") and fd.get("cause") == "sharding-bug":
        # a float64 backward through a choice rounding could flip: say why it is still evidence
        cf = v.get("choices_followed") if isinstance(v.get("choices_followed"), dict) else None
        chose = (f" (it made the runs' own choices at {', '.join(map(str, cf.get('ops') or ()))}: its forward "
                 f"reproduced both sides' row by row)" if cf else "")
        return (f"[bold red]BUG[/] at {where(fd)}: {what} re-executed in float64{chose} - {dist}: "
                f"{v['ratio']:.2g}x beyond rounding, a wrong result")
    if not v["far"]:
        return f"rounding at {where(fd)}: {what} re-executed in float64 - {dist}"
    return f"{where(fd)}: {what} re-executed in float64 - {dist}"


def _findings(console, label: str, d: dict, fd: dict) -> None:
    """Root findings one line each; records that follow from one are counted, not listed."""
    from tpdiag.records.causes import cause_class

    from tpdiag.diff.classes import roots

    findings = d.get("findings") or []
    # listed: the findings no other explains, by the rule the class and the gate group by
    root_ids = {id(f) for f in roots(findings, fd)}
    follows: dict = {}
    for f in findings:
        if id(f) not in root_ids:
            follows[f["follows"]] = follows.get(f["follows"], 0) + 1
    same = [f for f in findings if id(f) in root_ids and f.get("module") == fd.get("module")
            and f.get("cause") == fd.get("cause")]
    n = sum(follows.get(f.get("key"), 0) for f in same) + max(0, len(same) - 1)
    if n:
        console.print(f"{config_name(label)}: {n} later finding{'s' if n != 1 else ''} "
                      f"follow{'s' if n == 1 else ''} from the first divergence (not listed; "
                      f"{d.get('n_divergent', '?')} divergent records in all)")
    for f in findings:
        if id(f) not in root_ids or any(f is g for g in same):
            continue
        if f["cause"] == "non-finite":
            nf = d.get("nonfinite") or {}
            console.print(f"[red]finding[/] {config_name(label)}: {f['phase']} {f['module']} ({f['kind']} {f['name']}): "
                          f"non-finite - {_nonfinite_where(d, label)} ({nf.get('records', '?')} records hold "
                          "NaN or Inf, this the first)")
            continue
        rec = f"{f['kind']} {f['name']}" if f["kind"] != "op" else f"op {f['name']}"
        what = (f"{f['phase']} {f['module']} ({rec})" if not (f["phase"] == "loss" and f["module"] == "model")
                else f"loss: the loss function ({rec})")
        what += made_by(f)
        # a replica's value is its ranks' spread; every other one is against the reference
        vs = "between ranks" if f["cause"] == "rank-inconsistent-replica" else "vs the reference"
        r = f.get("bound_ratio")
        line = (f"[red]finding[/] {config_name(label)}: {what}: {f['cause']}, max abs {vs} {_fmt(f['max_abs'])}"
                # the bound is against the reference: no measure of a spread between ranks
                + (f" > bound {_fmt(f['bound'])}" if f.get("bound") and vs == "vs the reference" else "")
                + (f", {r:.3g}x beyond rounding" if r and r > 1 and cause_class(f["cause"]) == "bug" else ""))
        n = follows.get(f.get("key")) or 0
        if n:
            line += f"; and {n} later finding{'s' if n != 1 else ''} that follow{'s' if n == 1 else ''} from it (not listed)"
        if str(f.get("from") or "").startswith("confirmation"):
            # the same record again, from the confirmation rerun (under the fix): other numbers
            line += f" - in the {f['from'].replace('confirmation (', 'confirmation rerun (under ')}"
        if f.get("detail") and "split the weight tie" in str(f["detail"]):
            line += f": {f['detail']}"  # what the user must change: their plan (escaped by summary_tables)
        console.print(line)


def render_text(summary: dict, width: int = 200) -> str:
    """The text `tpdiag compare` prints for this summary into a file or a pipe (no terminal)."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    summary_tables(Console(file=buf, width=width, highlight=False), summary)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def _on_positions(cut) -> str:
    """A decode region pass on the first positions only (runner/prefix.py): what it saw."""
    n, L = cut
    return (f"the region pass (its op and values) ran positions 0..{n - 1} of {L} - the prompt call "
            f"and the one-token calls up to {n - 1} - where it found again every difference the "
            "first pass found in the modules it records")

