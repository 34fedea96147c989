"""`compare --verbose`: where the command's time went, from manifest.json's `time_breakdown`
(tpdiag/records/timing.py), as plain lines after the verdict."""
from __future__ import annotations


def time_lines(manifest: dict) -> list[str]:
    from tpdiag.records.timing import read_breakdown, rows, totals_line

    tb, problems = read_breakdown(manifest)
    if tb is None:
        return [f"time: no breakdown ({problems[0]})" if problems else "time: no breakdown in manifest.json"]
    out = [f"time: {tb['wall_s']:.1f} s in all"]
    for r in rows(tb):
        if r["part"] == "total":
            continue
        share = f"{100 * r['share']:4.0f}%" if r["share"] is not None else "    -"
        out.append(f"  {r['s']:8.1f} s {share}  {r['part']}: {r['what']}"
                   + (f" ({r['detail']})" if r["detail"] else ""))
    line = totals_line(tb)
    if line:
        out.append(f"  {line}")
    out += [f"  note: {p}" for p in problems]
    return out


def print_time(console, run_dir: str | None) -> None:
    if not run_dir:
        return
    from tpdiag.records.rundir import read_manifest

    try:
        manifest = read_manifest(run_dir)
    except Exception as e:  # noqa: BLE001 - the verdict is printed already: never fail on timings
        console.print(f"time: manifest.json unreadable ({type(e).__name__})", markup=False, soft_wrap=True)
        return
    for line in time_lines(manifest):
        console.print(line, markup=False, soft_wrap=True, highlight=False)
