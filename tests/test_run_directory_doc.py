"""docs/run-directory.md documents every key a real run directory holds.

The page's key tables (each after a `<!-- keys: NAME -->` line) give dotted paths: `<x>` stands
for any key of a map (a label, a module name), `x[]` for a list's element, `{a,b}` for several
keys, and a type `→ NAME` says the object's keys are table NAME's. The tests walk every key of a
real compare's summary.json, manifest.json, world.json and result.json files (the second pass's
run directory inside it too) and diff.csv's header, and fail naming each key no row documents;
every key CompareConfig/WorldConfig can write (the recipe keys too, which a default run leaves
out) must be documented as well. One shared run (conftest `tp12_run`), nothing written to it.
"""
from __future__ import annotations

import csv
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "run-directory.md")

MARK = re.compile(r"^<!-- keys: ([\w.-]+) -->\s*$")
SUB = re.compile(r"→\s*([\w.-]+)")


def _segments(path: str) -> tuple:
    """'a.b[].{x,y}.<label>' -> ('a', 'b', '[]', {'x','y'}, '<>'): a key, a list element, a set of
    keys, any key. Dots inside {...} or <...> do not split."""
    out, depth, cur = [], 0, ""
    for ch in path:
        if ch in "{<":
            depth += 1
        elif ch in "}>":
            depth -= 1
        if ch == "." and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    segs: list = []
    for s in out:
        items = 0
        while s.endswith("[]"):
            s, items = s[:-2], items + 1
        if s.startswith("<") and s.endswith(">"):
            segs.append("<>")
        elif s.startswith("{") and s.endswith("}"):
            segs.append(frozenset(x.strip() for x in s[1:-1].split(",")))
        else:
            segs.append(s)
        segs.extend(["[]"] * items)
    return tuple(segs)


def parse_tables(text: str) -> dict[str, list[tuple[tuple, str | None]]]:
    """{table: [(pattern segments, sub-table or None)]} from the page's marked tables."""
    tables: dict = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        i += 1
        if not m:
            continue
        name = m.group(1)
        assert name not in tables, f"table {name} twice"
        while i < len(lines) and not lines[i].startswith("|"):
            i += 1  # prose between the mark and its table
        rows = []
        while i < len(lines) and lines[i].startswith("|"):
            cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            i += 1
            first = re.fullmatch(r"`([^`]+)`", cells[0])
            if not first:
                continue  # the header and its rule
            sub = SUB.search(cells[1]) if len(cells) > 1 else None
            rows.append((_segments(first.group(1)), sub.group(1) if sub else None))
        tables[name] = rows
    return tables


def _match(pattern: tuple, path: tuple) -> bool:
    if len(pattern) != len(path):
        return False
    for p, k in zip(pattern, path):
        if p == "<>":
            if k == "[]":
                return False
        elif isinstance(p, frozenset):
            if k not in p:
                return False
        elif p != k:
            return False
    return True


def documented(tables: dict, table: str, path: tuple) -> bool:
    for pattern, sub in tables[table]:
        if _match(pattern, path):
            return True
        n = len(pattern)
        if sub and len(path) > n and _match(pattern, path[:n]) and documented(tables, sub, path[n:]):
            return True
    return False


def key_paths(obj, prefix: tuple = ()):
    """Every dict key's path in a JSON value; a list's elements add '[]'."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from key_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for v in obj:
            yield from key_paths(v, prefix + ("[]",))


def undocumented(tables: dict, table: str, obj) -> list[str]:
    return sorted({".".join(p).replace(".[]", "[]") for p in key_paths(obj) if not documented(tables, table, p)})


def _run_dirs(run_dir: str):
    """RUN_DIR and every run directory inside it (the second pass, confirmations, fix rounds)."""
    for d, subdirs, files in os.walk(run_dir):
        subdirs.sort()
        if "manifest.json" in files and "summary.json" in files:
            yield d


def check_run(tables: dict, run_dir: str) -> list[str]:
    """'FILE: key' for each key of a compare run directory's files the page does not document."""
    out = []

    def read(path):
        with open(path) as f:
            return json.load(f)

    for d in _run_dirs(run_dir):
        rel = "" if os.path.samefile(d, run_dir) else os.path.relpath(d, run_dir)
        for name, table in (("manifest.json", "manifest"), ("summary.json", "summary")):
            out += [f"{os.path.join(rel, name)}: {k}" for k in undocumented(tables, table, read(os.path.join(d, name)))]
        for sub in sorted(os.listdir(d)):
            for name, table in (("world.json", "world"), ("result.json", "result")):
                p = os.path.join(d, sub, name)
                if sub.startswith("tp") and os.path.isfile(p):
                    out += [f"{os.path.join(rel, sub, name)}: {k}" for k in undocumented(tables, table, read(p))]
        with open(os.path.join(d, "diff.csv"), newline="") as f:
            header = next(csv.reader(f))
        out += [f"{os.path.join(rel, 'diff.csv')}: column {c}" for c in header
                if not documented(tables, "diff.csv", (c,))]
    return out


def _tables(text=None):
    if text is None:
        with open(DOC) as f:
            text = f.read()
    return parse_tables(text)


def test_every_key_of_a_real_compare_is_documented(tp12_run):
    run = str(tp12_run)
    # what this run must hold for the walk to mean anything: the per-world files and a second pass
    assert os.path.isfile(os.path.join(run, "tp2", "world.json")) and os.path.isfile(os.path.join(run, "tp1-base", "result.json"))
    assert len(list(_run_dirs(run))) >= 2, "no second pass in the run: its directory would go unchecked"
    missing = check_run(_tables(), run)
    assert not missing, "keys docs/run-directory.md does not document:\n" + "\n".join(missing)


def test_every_config_key_is_documented():
    """manifest.json's and world.json's `config`: every key to_dict can write, the ones a default
    run leaves out (the logprob recipe, attentions, records_base ...) included."""
    from tpdiag.config import CompareConfig, WorldConfig, _layout

    tables = _tables()
    for cls, table in ((CompareConfig, "compare-config"), (WorldConfig, "world-config")):
        gaps = [k for k in _layout(cls) if not documented(tables, table, (k,))]
        assert not gaps, f"{cls.__name__} keys docs/run-directory.md ({table}) does not document: {gaps}"


def test_every_sub_table_named_exists():
    tables = _tables()
    named = {sub for rows in tables.values() for _, sub in rows if sub}
    assert named <= set(tables), f"→ names no table: {sorted(named - set(tables))}"
    for want in ("manifest", "summary", "world", "result", "diff.csv", "entry", "divergence"):
        assert tables.get(want), want


def test_the_check_names_a_key_the_doc_lacks(tp12_run):
    """Negative control: the page without one key's row fails naming that key, and a key no
    tpdiag writes, added to a copy of the summary, is named too."""
    with open(DOC) as f:
        text = f.read()
    row = next(line for line in text.splitlines() if line.startswith("| `reference_label` |"))
    cut = _tables(text.replace(row + "\n", ""))
    missing = check_run(cut, str(tp12_run))
    assert "summary.json: reference_label" in missing, missing
    # a nested key under a map placeholder and a sub-table: degrees.<label> -> entry
    row = next(line for line in text.splitlines() if line.startswith("| `{n_records,n_divergent}` |"))
    cut = _tables(text.replace(row, row.replace("{n_records,n_divergent}", "n_records")))
    assert "summary.json: degrees.2.n_divergent" in check_run(cut, str(tp12_run))
    tables = _tables()
    with open(os.path.join(str(tp12_run), "summary.json")) as f:
        summary = json.load(f)
    summary["degrees"]["2"]["first_divergence"]["no_such_key"] = 1
    assert undocumented(tables, "summary", summary) == ["degrees.2.first_divergence.no_such_key"]
