"""Rich tables as a file or a pipe should get them: plain columns, no right padding, no cell
wrapped (the CLI's tables: render.py, tables.py, rollout.py)."""
from __future__ import annotations


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


def _fmt(x, spec=".2e"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)
