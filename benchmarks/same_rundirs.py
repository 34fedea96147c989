"""Are two run directories the same, timings and provenance of the code aside? For a refactor
that must not change behaviour: run one compare with the old code and one with the new, then

    python3 benchmarks/same_rundirs.py OLD_RUN NEW_RUN

It walks both trees and compares every file: JSON and JSON-lines by value with the fields that
hold wall-clock times, dates, process ids, paths or the code's own version dropped; anything else
byte for byte. Prints each difference and exits 1 if there is one, 0 if none.
"""
from __future__ import annotations

import json
import os
import re
import sys

# keys whose values differ between any two runs of the same code (times, hosts, the run's paths)
VOLATILE = re.compile(r"(^|_)(s|sec|secs|seconds|time|times|timing|timings|started|finished|date|"
                      r"pid|host|hostname|elapsed|wall|duration|at|when|out|run_dir|path|dir|cwd|"
                      r"commit|git|version|tpdiag_version|breakdown|marks|phases_s|timestamp|available_bytes)$")
# rank markers (times and per-phase timings), logs, locks
SKIP_FILES = re.compile(r"(timing|timings|breakdown|\.done$|\.log$|\.lock$|progress)")


def _clean(x, root_old: str, root_new: str):
    if isinstance(x, dict):
        return {k: _clean(v, root_old, root_new) for k, v in x.items() if not VOLATILE.search(k)}
    if isinstance(x, list):
        return [_clean(v, root_old, root_new) for v in x]
    if isinstance(x, str):
        return x.replace(root_old, "RUN").replace(root_new, "RUN")
    return x


def _load(path: str):
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".json"):
        return json.loads(data)
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in data.splitlines() if line.strip()]
    return data


def _diff(a, b, where: str, out: list) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'new' if k not in a else 'old'}")
            else:
                _diff(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", out)
    elif a != b:
        show = lambda v: (repr(v)[:200])  # noqa: E731
        out.append(f"{where}: {show(a)} != {show(b)}")


def compare(old: str, new: str) -> list[str]:
    out: list[str] = []
    files = set()
    for root in (old, new):
        for d, _, names in os.walk(root):
            files |= {os.path.relpath(os.path.join(d, n), root) for n in names}
    for rel in sorted(files):
        if SKIP_FILES.search(os.path.basename(rel)):
            continue
        a, b = os.path.join(old, rel), os.path.join(new, rel)
        if not os.path.exists(a) or not os.path.exists(b):
            out.append(f"{rel}: only in {'old' if os.path.exists(a) else 'new'}")
            continue
        x, y = _load(a), _load(b)
        if isinstance(x, bytes):
            if x != y:
                out.append(f"{rel}: bytes differ")
            continue
        _diff(_clean(x, old, new), _clean(y, old, new), rel, out)
    return out


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    diffs = compare(*argv)
    for d in diffs:
        print(d)
    print(f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
