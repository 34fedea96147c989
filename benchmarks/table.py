"""`python -m benchmarks --table JOB`: a job's recorded history (benchmarks/results.jsonl) as a
table, one line per run - or per row of a run whose figures hold a list of rows (fix-cost's
sizes, compare's runs, gemm's shapes) - oldest first.

Columns: when, commit, GPU, then the figures named by the job's `table` patterns in
benchmarks/registry.py (dotted paths, `*` one path segment, e.g. `configs.*.x_stock`), then the
job's arguments. `--columns PAT[,PAT]` picks others, `--columns all` every figure;
`--last N` the newest N runs only."""
from __future__ import annotations

import json
import os
import re

ROWS_KEYS = ("rows", "runs", "speed", "jobs")  # a list of dicts under one of these: a line each


def load(path: str, job: str) -> list[dict]:
    """The job's records in file order; a line that is not JSON is skipped, not fatal."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for ln in f:
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("job") == job:
                out.append(rec)
    return out


def flatten(x, prefix: str = "") -> dict:
    """Scalar leaves by dotted path; lists of scalars as one comma-joined value."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(x, list) and not any(isinstance(v, (dict, list)) for v in x):
        return {prefix[:-1]: ",".join(map(str, x))}
    if isinstance(x, list):
        return {}  # a list of structures inside a row: too deep for one line
    return {prefix[:-1]: x}


def rows_of(rec: dict) -> list[dict]:
    """One dict of figures per table line: the figures' first list of rows expanded, each row
    with the run-level scalars beside it."""
    figs = rec.get("figures") if isinstance(rec.get("figures"), dict) else {}
    for key in ROWS_KEYS:
        items = figs.get(key)
        if isinstance(items, list) and items and all(isinstance(i, dict) for i in items):
            top = flatten({k: v for k, v in figs.items() if k != key})
            return [{**top, **flatten(i)} for i in items]
    return [flatten(figs)]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _glob(pat: str):
    return re.compile("[^.]*".join(re.escape(part) for part in pat.split("*")))


def pick(paths: list[str], patterns) -> list[str]:
    """The paths matching any pattern (`*` = one dotted segment), in the patterns' order."""
    if tuple(patterns) == ("all",):
        return paths
    out = []
    for pat in patterns:
        rx = _glob(pat)
        out += [p for p in paths if rx.fullmatch(p) and p not in out]
    return out


def table(records: list[dict], patterns) -> list[str]:
    lines = []
    for rec in records:
        for row in rows_of(rec):
            lines.append((rec, row))
    paths: list[str] = []
    for _, row in lines:
        paths += [p for p in row if p not in paths]
    cols = pick(paths, tuple(patterns))
    head = ["date", "commit", "gpu", *cols, "args"]
    body = []
    for rec, row in lines:
        gpu = rec.get("gpu") or f"cpu ({rec.get('machine', '?')})"
        body.append([str(rec.get("date", "?"))[:16].replace("T", " "), str(rec.get("commit") or "-"),
                     gpu.replace("NVIDIA ", ""), *(_fmt(row.get(c)) for c in cols),
                     " ".join(map(str, rec.get("args") or [])) or "-"])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
