"""`manifest.json` `time_breakdown` (written by tpdiag/runner/timing.py), read and checked.

Timings are provenance, not evidence: no verdict depends on them. So a malformed breakdown (a
hand-edited or foreign manifest) never makes a run inconclusive and never crashes a reader:
`read_breakdown` keeps the entries that are well formed and says, in words, what it dropped;
the report prints that beside the table, the gate does not read timings at all.
"""
from __future__ import annotations

import math

SCHEMA = 1
PART_KINDS = ("checks", "setup", "world", "diff", "second-pass", "confirm", "fix-chain", "other")
# sums over every world of the command (overlapping the parts): docs/internals.md#timing-fields
TOTALS = ("worlds", "start_s", "model_build_s", "selfcheck_s", "steps_s", "gather_s", "write_s",
          "float64_s", "triton_compile_s", "triton_compiles")
# parts are rounded to the millisecond each: their sum may pass wall_s by that much per part
_ROUNDING = 0.0005


def _seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def read_breakdown(manifest) -> tuple[dict | None, list[str]]:
    """(the breakdown with only well-formed entries, or None when there is none; problems)."""
    tb = manifest.get("time_breakdown") if isinstance(manifest, dict) else None
    if tb is None:
        return None, []
    where = "manifest.json time_breakdown"
    if not isinstance(tb, dict):
        return None, [f"{where}: not an object ({type(tb).__name__})"]
    problems = []
    if type(tb.get("schema")) is not int or tb.get("schema") != SCHEMA:
        return None, [f"{where}: schema {tb.get('schema')!r}; this tpdiag reads schema {SCHEMA}"]
    wall = tb.get("wall_s")
    if not _seconds(wall):
        return None, [f"{where}: wall_s {wall!r} is not a number of seconds >= 0"]
    parts = []
    raw = tb.get("parts")
    if not isinstance(raw, list):
        problems.append(f"{where}: parts is not a list")
        raw = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict) or p.get("part") not in PART_KINDS or not _seconds(p.get("s")):
            problems.append(f"{where}: parts[{i}] dropped (expected part in {', '.join(PART_KINDS)} and "
                            f"s >= 0, got {str(p)[:80]})")
            continue
        worlds = p.get("worlds")
        parts.append({"part": p["part"], "what": str(p.get("what") or ""), "s": float(p["s"]),
                      **({"worlds": {str(k): v for k, v in worlds.items() if _seconds(v)}}
                         if isinstance(worlds, dict) else {}),
                      **({"diff_s": p["diff_s"]} if _seconds(p.get("diff_s")) else {})})
    total = sum(p["s"] for p in parts)
    if total > wall + _ROUNDING * (len(parts) + 1):
        problems.append(f"{where}: the parts add up to {total:.3f} s, more than the wall time {wall:.3f} s")
    totals = {}
    raw_totals = tb.get("totals") if isinstance(tb.get("totals"), dict) else {}
    if "totals" in tb and not isinstance(tb.get("totals"), dict):
        problems.append(f"{where}: totals is not an object")
    for k, v in raw_totals.items():
        if k in TOTALS and _seconds(v):
            totals[k] = v
        elif k in TOTALS:
            problems.append(f"{where}: totals.{k} {v!r} dropped (not a number >= 0)")
    return {"schema": SCHEMA, "wall_s": float(wall), "parts": parts, "totals": totals}, problems


_TOTAL_WORDS = (("start_s", "start (spawn, imports, process group)"), ("model_build_s", "model build"),
                ("selfcheck_s", "unprobed self-check run (the world's build included)"),
                ("steps_s", "probed steps"), ("float64_s", "float64 re-execution (inside the steps)"),
                ("triton_compile_s", "Triton compiles (inside the runs)"), ("gather_s", "gather"),
                ("write_s", "write"))


def _detail(p: dict) -> str:
    from tpdiag.base.points import config_name

    bits = [f"{config_name(k.rsplit('/', 1)[-1])}{' (' + k.rsplit('/', 1)[0] + ')' if '/' in k else ''} "
            f"{v:.1f} s" for k, v in (p.get("worlds") or {}).items()]
    if p.get("diff_s") is not None:
        bits.append(f"diff {p['diff_s']:.1f} s")
    return ", ".join(bits)


def rows(tb: dict) -> list[dict]:
    """A checked breakdown (read_breakdown) as display rows: part, what, seconds, share of the
    wall time, detail (a rerun's worlds and diff)."""
    wall = tb["wall_s"] or 0.0
    out = [{"part": p["part"], "what": p["what"], "s": p["s"],
            "share": (p["s"] / wall if wall > 0 else None), "detail": _detail(p)} for p in tb["parts"]]
    out.append({"part": "total", "what": "the whole command", "s": wall, "share": 1.0 if wall > 0 else None,
                "detail": ""})
    return out


def totals_line(tb: dict) -> str | None:
    """The worlds' sums in one line (they overlap the parts), or None without any."""
    t = tb.get("totals") or {}
    bits = []
    for k, words in _TOTAL_WORDS:
        if k in t:
            extra = f" ({t['triton_compiles']} kernels)" if k == "triton_compile_s" and "triton_compiles" in t else ""
            bits.append(f"{words} {t[k]:.1f} s{extra}")
    if not bits:
        return None
    n = t.get("worlds")
    return f"in the {n} worlds' slowest ranks: " + ", ".join(bits) if n else ", ".join(bits)
