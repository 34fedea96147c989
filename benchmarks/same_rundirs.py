"""Are two tpdiag trees' run directories the same, timings aside? (issue 62 item 6: a refactor
keeps every run directory byte-identical.)

    python3 benchmarks/same_rundirs.py OLD_TREE NEW_TREE [WORK_DIR] [--ignore KEY ...]

runs each case below with `PYTHONPATH=TREE python3 -m tpdiag compare ...` into WORK_DIR/<tree>/<case>
and compares the two directories file by file: the same file names, safetensors and CSV byte for
byte, JSON (and JSON lines) equal once the keys that hold times, hosts, process ids and paths are
dropped (and the keys named by --ignore: what the change adds on purpose, e.g. `--ignore sdpa_ran
--ignore line` for the SDPA backend compare now records). Prints one line per difference, with the
key paths that differ; exits 1 if any. OLD_TREE can be a `git archive` of the commit before the change.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

TINY = ["--batch-size", "4", "--seq-len", "8", "--no-confirm"]
CASES = {
    "tp": ["--tp", "1,2", *TINY],
    "tp-repeat": ["--tp", "1,1", *TINY, "--forward-only"],
    "mb-grid": ["--tp", "1,2", "--micro-batch", "4,2", "--grid", *TINY, "--forward-only", "--no-baseline"],
    "decode": ["--tp", "1", "--mode", "prefill,decode", *TINY, "--forward-only", "--no-baseline"],
}
# keys whose values are times, hosts, process ids or paths: never the same between two runs
VOLATILE = ("wall_s", "timings", "rank_timings", "started", "phases", "host", "pid", "out", "out_dir",
            "ref_dir", "run_dir", "seconds", "_s", "s", "elapsed", "time", "path", "cpu_count", "preflight",
            "time_breakdown", "op_run_dir", "second_pass_dir", "dir")
IGNORED: list[str] = []


def _strip(x, root: str):
    """x without its volatile keys, and a path inside the run directory (under a key of its own,
    as drill's own-input files in the rerun's config) relative to it: the two runs' directories differ."""
    if isinstance(x, dict):
        return {k: _strip(v, root) for k, v in x.items()
                if k not in IGNORED and not any(k == v_ or (v_.startswith("_") and k.endswith(v_)) for v_ in VOLATILE)}
    if isinstance(x, list):
        return [_strip(v, root) for v in x]
    if isinstance(x, str) and x.startswith(root + os.sep):
        return "<run>" + x[len(root):]
    return x


def _json_lines(path: str, root: str):
    with open(path) as f:
        text = f.read()
    try:
        return [_strip(json.loads(text), root)]
    except ValueError:
        return [_strip(json.loads(line), root) for line in text.splitlines() if line.strip()]


def _paths(x, y, at: str = "") -> list[str]:
    """Where two JSON values differ, as key paths ('/worlds/1/numerics/sdpa_ran')."""
    if isinstance(x, dict) and isinstance(y, dict):
        return [p for k in sorted(set(x) | set(y), key=str) if x.get(k) != y.get(k)
                for p in _paths(x.get(k), y.get(k), f"{at}/{k}")]
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return [p for i, (u, v) in enumerate(zip(x, y)) if u != v for p in _paths(u, v, f"{at}[{i}]")]
    return [at or "/"]


def _files(root: str) -> set[str]:
    out = set()
    for d, _, names in os.walk(root):
        out |= {os.path.relpath(os.path.join(d, n), root) for n in names}
    return out


def same(a: str, b: str) -> list[str]:
    fa, fb = _files(a), _files(b)
    diffs = [f"only in {a}: {n}" for n in sorted(fa - fb)] + [f"only in {b}: {n}" for n in sorted(fb - fa)]
    for n in sorted(fa & fb):
        pa, pb = os.path.join(a, n), os.path.join(b, n)
        if n.endswith((".json", ".jsonl")):
            ja, jb = _json_lines(pa, os.path.abspath(a)), _json_lines(pb, os.path.abspath(b))
            if ja != jb:
                where = _paths(ja, jb)
                diffs.append(f"differs (timings aside): {n} at {', '.join(where[:6])}"
                             f"{f' (+{len(where) - 6})' if len(where) > 6 else ''}")
        elif n.endswith((".lock", ".done", ".log")):
            continue
        else:
            with open(pa, "rb") as x, open(pb, "rb") as y:
                if x.read() != y.read():
                    diffs.append(f"differs (bytes): {n}")
    return diffs


def main(argv: list[str]) -> int:
    while "--ignore" in argv:
        i = argv.index("--ignore")
        IGNORED.append(argv[i + 1])
        del argv[i:i + 2]
    old, new = argv[1], argv[2]
    work = argv[3] if len(argv) > 3 else "/tmp/same-rundirs"
    bad = 0
    for case, args in CASES.items():
        dirs = []
        for tag, tree in (("old", old), ("new", new)):
            out = os.path.join(work, tag, case)
            if not os.path.exists(os.path.join(out, "summary.json")):
                env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
                # run from the tree: `python -m` puts the working directory before PYTHONPATH
                subprocess.run([sys.executable, "-m", "tpdiag", "compare", *args, "--out", os.path.abspath(out),
                                "--format", "json"], env=env, cwd=os.path.abspath(tree), stdout=subprocess.DEVNULL,
                               check=False)
            dirs.append(out)
        diffs = same(*dirs)
        print(f"{case}: {'same' if not diffs else f'{len(diffs)} differences'}")
        for d in diffs:
            print(f"  {d}")
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
