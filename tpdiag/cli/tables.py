"""The CLI's other tables: the mitigation matrix, the fix catalogue, doctor's checks (rich)."""
from __future__ import annotations

from tpdiag.cli.plain_table import _box, _fmt, _natural_width, _print_table
from tpdiag.records.causes import short_name



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
                lines.append(short_name(fd["cause"]))
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
