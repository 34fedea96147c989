"""Rich rendering for the CLI (the only place besides cli.py that touches rich)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from tpdiag.axes import config_name


def _box(console, box):
    """Box drawing on a terminal only: a file or a pipe gets plain columns (and rich already
    drops colour codes there), so CI logs and `> out.txt` read like the README."""
    return box if console.is_terminal else None


def _natural_width(console, table) -> int:
    """Columns the table takes with no cell wrapped."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(100_000), table).maximum


def _print_table(console, table) -> None:
    """A table; off a terminal without the padding rich adds to the right of every line, and as
    wide as its longest cell needs: a pipe has no width to fit, and a cell wrapped there breaks
    its sentence over lines."""
    if console.is_terminal:
        console.print(table)
        return
    width = console.width
    console.width = max(width, _natural_width(console, table))
    try:
        with console.capture() as cap:
            console.print(table)
    finally:
        console.width = width
    console.file.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))


@contextmanager
def progress(console, cfg, quiet: bool = False):
    """Live per-world status on a terminal; nothing at all with --quiet or when stderr is a
    file or a pipe (a spinner there leaves control lines and a stale last frame)."""
    if quiet or not console.is_terminal:
        yield lambda label, status: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    labels = [w.label for w in cfg.worlds()]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as p:
        tasks = {lab: p.add_task(f"{config_name(lab)}{' (reference)' if i == 0 else ''}: waiting", total=1)
                 for i, lab in enumerate(labels)}
        tasks["diff"] = p.add_task("diff: waiting", total=1)
        started = {}

        def on_status(label: str, status: str) -> None:
            t = tasks.get(label)
            if t is None:
                if label in ("confirm", "auto", "variant"):
                    key = f"{label}:{status}"
                    if key not in tasks:
                        tasks[key] = p.add_task(f"{label}: {status}", total=None)
                    for k, tid in tasks.items():
                        if k.startswith(label + ":") and k != key:
                            p.update(tid, total=1, completed=1)
                return
            name = "diff" if label == "diff" else f"{config_name(label)}"
            if status.startswith("running:"):  # progress inside the world (runner/progress.py)
                p.update(t, description=f"{name}: running, {status[len('running:'):]}")
            elif status == "running":
                started[label] = time.perf_counter()
                p.update(t, description=f"{name}: running")
            else:
                dt = time.perf_counter() - started.get(label, time.perf_counter())
                mark = "[green]done[/]" if status == "ok" else "[red]FAILED[/]"
                p.update(t, description=f"{name}: {mark} ({dt:.1f} s)", completed=1)

        yield on_status


def _fmt(x, spec=".2e"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def where(fd: dict) -> str:
    """A record in words: 'forward: layers.0.attention.wo', 'loss: logprobs', 'backward: output (grad_out 0)'."""
    phase, module, kind, name = fd.get("phase"), fd.get("module"), fd.get("kind"), fd.get("name")
    if module == "model":  # whole-model records (logprobs, loss, grad norm) have no module of their own
        text = f"{phase}: {name if name == kind or not kind else f'{kind} {name}'}"
    else:
        text = f"{phase}: {module}" + (f" :: {fd['op']}" if fd.get("op") else "")
        if kind not in ("out", None):
            text += f" ({kind})" if name in (kind, None, "") else f" ({kind} {name})"
    return text


def ran(summary: dict) -> str | None:
    steps = summary.get("steps")
    if steps is None:
        return None
    what = "forward, backward and optimizer step" if summary.get("backward", True) else "forward only"
    line = f"ran: {steps} step{'s' if steps != 1 else ''} at each degree ({what})"
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

    status = summary["status"]
    color = {"bitwise": "green", "divergent": "yellow", "inconclusive": "red"}.get(status, "white")
    console.print(f"[bold]verdict:[/] [{color}]{status}[/]{_class_words(summary)} "
                  f"(reference {config_name(summary['reference_label'])})")
    base = summary.get("baseline")
    if ran(summary):
        console.print(ran(summary))
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
    t.add_column("first divergence", overflow="fold", min_width=30)
    t.add_column("cause", overflow="fold", min_width=22)
    t.add_column("max abs / bound", no_wrap=True)
    t.add_column("ULP", no_wrap=True)
    t.add_column("logprob err", no_wrap=True)
    for label, d in entries(summary).items():
        if d["status"] == "failed":
            t.add_row(label, "[red]failed[/]", d.get("error", ""), "-", "-", "-", "-")
            continue
        fd = d.get("first_divergence") or {}
        lp = d.get("logprobs") or {}
        st = "[green]bitwise[/]" if d["status"] == "bitwise" else "[yellow]divergent[/]"
        err = f"{_fmt(fd.get('max_abs'))} / {_bound_cell(fd)}" if fd else "-"
        if fd.get("cause") == "non-finite":  # no size to compare with a bound: say what it is
            err = f"{(d.get('nonfinite') or {}).get('first', {}).get('value', 'nan or inf')} at one side"
        lperr = (f"{_fmt(lp.get('max_abs'))} (x{lp['token_mult_prob_error']:.7f})"
                 if lp.get("max_abs") is not None else "-")
        t.add_row(label, st, where(fd) if fd else "-", fd.get("cause", "-"), err, _fmt(fd.get("max_ulp")), lperr)
    _print_table(console, t)
    for label, d in entries(summary).items():
        fd = d.get("first_divergence") or {}
        if fd.get("oracle") or fd.get("op_oracle"):
            console.print(f"{config_name(label)}: {oracle_line(fd)}")
        if fd.get("why"):
            console.print(f"{config_name(label)}: cause {fd['cause']}: {fd['why']}")
        _findings(console, label, d, fd)
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
        firsts = ", ".join(f"{config_name(lab)}: {fd['cause']} at {fd['module']}" for lab, fd in
                           rnd["first_divergence"].items() if fd) or "-"
        console.print(f"fix chain round {rnd['round']} ({', '.join(rnd['fixes']) or 'stock'}): "
                      f"{rnd['status']}; {firsts}" + (f" ({rnd['stopped']})" if rnd.get("stopped") else ""))
    if summary.get("status_after_fixes"):
        console.print(f"[bold]after fixes:[/] {summary['status_after_fixes']}")
    if summary.get("error"):
        console.print(f"[red]{summary['error']}[/]")
    todo = what_to_do(summary)
    if todo:
        console.print(f"[bold]what to do:[/] {todo}")
    if summary.get("run_dir"):
        console.print(f"run directory: {summary['run_dir']}  (tpdiag report {summary['run_dir']})")


def _class_words(summary: dict) -> str:
    """The headline's bug-or-rounding part: ', BUG' / ', rounding only' / ', not judged'."""
    c = summary.get("class")
    if summary.get("status") != "divergent" or not c:
        return ""
    return {"bug": ", [bold red]BUG[/] (a wrong result, not rounding)",
            "non-finite": ", [bold red]NON-FINITE[/] (NaN or Inf on one side only)",
            "rounding": ", rounding only", "unknown": ", not judged (cause unknown)"}[c]


def _bound_cell(fd: dict) -> str:
    v = fd.get("oracle") or fd.get("op_oracle")
    if fd.get("bound") is None and v:
        return f"float64 x{v['ratio']:.2g}"
    return _fmt(fd.get("bound"))


def oracle_line(fd: dict) -> str:
    """The float64 verdict in words (diff/oracle.py)."""
    v = fd.get("oracle") or fd.get("op_oracle")
    what = ("its op" if not fd.get("oracle") else
            {"param_grad": "the module's backward", "grad_out": "its consumer's backward"}.get(
                fd.get("kind"), "the module"))
    unit = "relative " if v.get("relative") else ""
    dist = (f"this side {v['err']:.2e} from it, the reference {v['ref_err']:.2e} ({unit}2-norm; "
            f"rounding allows {v['threshold']:.2e})")
    if v["far"] and not v.get("discrete") and fd.get("cause") == "sharding-bug":
        return (f"[bold red]BUG[/] at {where(fd)}: {what} re-executed in float64 - {dist}: "
                f"{v['ratio']:.2g}x beyond rounding, a wrong result")
    if not v["far"]:
        return f"rounding at {where(fd)}: {what} re-executed in float64 - {dist}"
    return f"{where(fd)}: {what} re-executed in float64 - {dist}"


def _findings(console, label: str, d: dict, fd: dict) -> None:
    """Root findings one line each; records that follow from one are counted, not listed."""
    findings = d.get("findings") or []
    follows: dict = {}
    for f in findings:
        if "follows" in f:
            follows[f["follows"]] = follows.get(f["follows"], 0) + 1
    same = [f for f in findings if "follows" not in f and f.get("module") == fd.get("module")
            and f.get("cause") == fd.get("cause")]
    n = sum(follows.get(f.get("key"), 0) for f in same) + max(0, len(same) - 1)
    if n:
        console.print(f"{config_name(label)}: {n} downstream record{'s' if n != 1 else ''} "
                      f"follow{'s' if n == 1 else ''} from the first divergence (not listed)")
    for f in findings:
        if "follows" in f or any(f is g for g in same):
            continue
        if f["cause"] == "non-finite":
            nf = d.get("nonfinite") or {}
            console.print(f"[red]finding[/] {config_name(label)}: {f['phase']} {f['module']} ({f['kind']} {f['name']}): "
                          f"non-finite - {nf.get('first', {}).get('value', 'nan or inf')} at {config_name(label)} "
                          f"only ({nf.get('records', '?')} records non-finite at one side, this the first)")
            continue
        rec = f"{f['kind']} {f['name']}" if f["kind"] != "op" else f"op {f['name']}"
        line = (f"[red]finding[/] {config_name(label)}: {f['phase']} {f['module']} ({rec}): {f['cause']}, "
                f"max abs {_fmt(f['max_abs'])}" + (f" > bound {_fmt(f['bound'])}" if f.get("bound") else ""))
        n = follows.get(f.get("key")) or 0
        if n:
            line += f"; {n} downstream record{'s' if n != 1 else ''} follow{'s' if n == 1 else ''} from it"
        console.print(line)


def what_to_do(summary: dict) -> str | None:
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
        return ("nothing could judge the first divergence (the reason is above); "
                f"`tpdiag report {run}` shows its values")
    from tpdiag.records.axes import entries

    if all(config_name(lab) == f"TP={lab}" for lab in entries(summary)):
        return ("nothing is wrong: the degrees differ by rounding only. Harmless unless you need "
                "bitwise equality across TP; then `tpdiag compare --fix auto` applies the fixes that remove it")
    return ("nothing is wrong: the configurations differ by rounding only. Harmless unless you need "
            "bitwise equality across them; then `tpdiag compare --fix auto` applies the fixes that remove "
            "what they cover (docs/micro-batch.md and docs/decode.md say what they do not)")


_SHORT_CAUSE = {"row-parallel-reduction": "row-par-reduce", "vocab-parallel-softmax": "vocab-softmax",
                "shape-dependent-gemm": "shape-gemm", "column-parallel-dgrad": "col-par-dgrad"}


def matrix_table(console, matrix: dict) -> None:
    """The mitigation matrix (compare --variants): one row per variant, one column per degree."""
    from rich import box
    from rich.table import Table

    ref = matrix["reference"]
    plain = not console.is_terminal
    t = Table(title=f"mitigation matrix (each variant against its own TP={ref})", show_lines=True,
              pad_edge=False, box=_box(console, box.HEAVY_HEAD), title_justify="left")
    t.add_column("variant", no_wrap=True)
    for lab in matrix["degrees"]:
        t.add_column(f"TP={lab}" + (" (reference)" if lab == ref else ""), overflow="fold")
    for name in matrix["variants"]:
        row = [name]
        for lab in matrix["degrees"]:
            c = matrix["cells"][name][lab]
            st = c["status"]
            color = {"bitwise": "green", "divergent": "yellow", "failed": "red"}.get(st, "cyan")
            lines = [f"[{color}]{st}[/]"]
            if st == "failed":
                lines.append(str(c.get("error") or "")[:80])
            fd = c.get("first_divergence")
            if fd:
                lines.append(f"{fd['phase']} {fd['module']} ({fd['kind']})")
                lines.append(_SHORT_CAUSE.get(fd["cause"], fd["cause"]))
            if st in ("bitwise", "divergent"):
                tm = c.get("token_mult_prob_error")
                lines.append(f"logprob {_fmt(c.get('logprob_max_abs'))}"
                             + (f" x{tm:.7f}" if tm is not None and not c.get("logprobs_bitwise") else ""))
                lines.append(f"loss diff {_fmt(c.get('loss_abs_diff'))}"
                             + (f", last step {_fmt(c['loss_abs_diff_last_step'])}"
                                if c.get("loss_abs_diff_last_step") is not None else ""))
            if c.get("step_s") is not None:
                rel = c.get("step_time_vs_stock")
                lines.append(f"step {c['step_s']:.3f} s" + (f" (x{rel:.2f})" if rel is not None else ""))
            row.append("\n".join(lines))
        t.add_row(*row)
        if plain:  # no rule lines between variants without a box: a blank row instead
            t.add_row(*[""] * (1 + len(matrix["degrees"])))
    _print_table(console, t)
    console.print("step time: one measured optimizer step with probes on, relative to stock at the same "
                  "degree; small-model numbers, noisy on a shared machine")
    bad = {n: r.get("error") for n, r in matrix.get("runs", {}).items() if r.get("error")}
    for n, e in bad.items():
        console.print(f"[red]{n}[/]: {e}")


def fixes_table(console, rows: list[dict]) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="tpdiag fixes", box=_box(console, box.HEAVY_HEAD), pad_edge=False, title_justify="left")
    t.add_column("fix", no_wrap=True)  # the name a user types after --fix: never cut
    for c in ("removes cause", "replaces", "cost", "available"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["name"], ", ".join(r["fixes"]), escape(", ".join(r["ops"])), escape(r["cost"]),
                  "yes" if r["available"] else "not yet")
    if console.is_terminal and _natural_width(console, t) > console.width:
        # Too narrow for the table: its cells would cut op and cause names with '...'. One block
        # per fix instead, wrapped at spaces.
        for r in rows:
            console.print(f"[bold]{r['name']}[/] ({'available' if r['available'] else 'not yet available'})")
            for k, v in (("removes cause", ", ".join(r["fixes"])), ("replaces", ", ".join(r["ops"])),
                         ("cost", r["cost"])):
                console.print(f"  {k}: {escape(v)}")
    else:
        _print_table(console, t)
    console.print("what each cause and fix means: docs/causes.md")


def doctor_report(console, checks: list) -> None:
    """One line per check: name, value, verdict (ok / will make results non-reproducible / informational)."""
    from rich.markup import escape

    color = {"ok": "green", "informational": "cyan"}
    wn = max(len(c.name) for c in checks)
    for c in checks:
        col = color.get(c.verdict, "red")
        console.print(f"{c.name:<{wn}}  [{col}]{c.verdict}[/]: {escape(c.value)}"
                      + (f" - {escape(c.why)}" if c.why else ""), soft_wrap=True)
    bad = sum(c.verdict not in color for c in checks)
    console.print(f"doctor: {bad} setting(s) will make results non-reproducible" if bad
                  else "doctor: nothing here makes results non-reproducible")


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
