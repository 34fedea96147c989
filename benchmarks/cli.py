"""`python -m benchmarks [--results PATH] [--no-record] <job> [job args]`, `--list`,
`--ingest FILE`, `--table JOB` (the job's recorded history, benchmarks/table.py). Environment: TPDIAG_BENCH_RESULTS (= --results), TPDIAG_BENCH_NO_RECORD=1
(= --no-record), TPDIAG_GIT_COMMIT (the commit recorded where the copy has no .git), OUT (each
line is also appended to $OUT/results.jsonl). Exit codes: the job's (0 done, 1 a check
failed), 2 unknown job or bad arguments, 3 the job cannot run here (needs CUDA, more GPUs, or a
module not in this checkout)."""
from __future__ import annotations

import importlib
import os
import sys
import time

from benchmarks.errors import JobUnavailable, NeedsCuda
from benchmarks.registry import JOBS

USAGE = ("usage: python -m benchmarks [--results PATH] [--no-record] JOB [ARGS...] | --list | "
         "--ingest FILE [--results PATH] | --table JOB [--columns PAT[,PAT]|all] [--last N] [--results PATH]")


def _list() -> str:
    w = max(map(len, JOBS))
    return "\n".join(f"{name:<{w}}  {job.summary} [{job.needs}]" for name, job in JOBS.items())


def load(name: str):
    job = JOBS[name]
    try:
        return importlib.import_module(job.module)
    except ModuleNotFoundError as e:
        if e.name == job.module:  # not a missing dependency inside the module: that is a real error
            raise JobUnavailable(f"job {name!r} is registered but its module {job.module} is not in this "
                                 "checkout") from None
        raise


def _table(argv: list[str], results: str | None) -> int:
    """--table JOB [--columns PAT[,PAT]|all] [--last N] [--results PATH]: no job runs."""
    import argparse

    from benchmarks import record, table

    ap = argparse.ArgumentParser(prog="python -m benchmarks --table", add_help=False)
    ap.add_argument("job")
    ap.add_argument("--columns")
    ap.add_argument("--last", type=int)
    ap.add_argument("--results", default=results)
    try:
        a = ap.parse_args(argv)
    except SystemExit:
        print(f"benchmarks: {USAGE}", file=sys.stderr)
        return 2
    if a.job not in JOBS:
        print(f"benchmarks: unknown job {a.job!r}; jobs: {', '.join(JOBS)}", file=sys.stderr)
        return 2
    path = a.results or record.DEFAULT_RESULTS
    recs = table.load(path, a.job)
    if a.last:
        recs = recs[-a.last:]
    if not recs:
        print(f"benchmarks: no {a.job} runs recorded in {path}", file=sys.stderr)
        return 0
    cols = tuple(c.strip() for c in a.columns.split(",") if c.strip()) if a.columns else JOBS[a.job].table
    print("\n".join(table.table(recs, cols)))
    return 0


def main(argv: list[str]) -> int:
    from benchmarks import record

    if argv[:1] == ["--table"] or any(a == "--table" for a in argv[:3]):
        rest = [a for a in argv if a != "--table"]
        return _table(rest, os.environ.get("TPDIAG_BENCH_RESULTS"))

    results = os.environ.get("TPDIAG_BENCH_RESULTS")
    write, ingest = os.environ.get("TPDIAG_BENCH_NO_RECORD") != "1", None
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        a, val = argv[i], None
        if a in ("-l", "--list"):
            print(_list())
            return 0
        if a in ("-h", "--help"):
            print(USAGE + "\n\njobs:\n" + _list())
            return 0
        if a == "--no-record":
            write = False
        elif a.split("=", 1)[0] in ("--results", "--ingest"):
            if "=" in a:
                a, val = a.split("=", 1)
            elif i + 1 < len(argv):
                i += 1
                val = argv[i]
            else:
                print(f"benchmarks: {a} needs a path", file=sys.stderr)
                return 2
            if a == "--results":
                results = val
            else:
                ingest = val
        else:
            print(f"benchmarks: unknown option {a!r}; {USAGE}", file=sys.stderr)
            return 2
        i += 1
    if ingest:
        if not os.path.exists(ingest):
            print(f"benchmarks: --ingest {ingest}: no such file", file=sys.stderr)
            return 2
        dst = results or record.DEFAULT_RESULTS
        print(f"{record.ingest(ingest, dst)} new lines appended to {dst}")
        return 0
    if i >= len(argv):
        print(f"benchmarks: no job given; {USAGE}", file=sys.stderr)
        return 2
    # the suite's child jobs inherit where (and whether) to record
    if results:
        os.environ["TPDIAG_BENCH_RESULTS"] = results
    if not write:
        os.environ["TPDIAG_BENCH_NO_RECORD"] = "1"
    name, args = argv[i], argv[i + 1:]
    if name not in JOBS:
        print(f"benchmarks: unknown job {name!r}; jobs: {', '.join(JOBS)}", file=sys.stderr)
        return 2
    job = JOBS[name]
    if "--smoke" in args:
        for k, v in job.smoke_env.items():
            os.environ.setdefault(k, v)
    full_args = list(job.prefix) + list(args)
    t0 = time.perf_counter()
    try:
        figures = load(name).main(full_args)
    except NeedsCuda as e:
        print(f"benchmarks: {e}", file=sys.stderr)
        return 3
    except JobUnavailable as e:
        print(f"benchmarks {name}: {e}", file=sys.stderr)
        return 3
    except SystemExit as e:  # argparse: bad arguments (2) or --help (0)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else 2
    wall = time.perf_counter() - t0
    if figures is None:
        figures = {}
    rec = record.make_record(name, full_args, figures, wall)
    smoke = rec["smoke"]
    # smoke figures say nothing about speed: they go to history only where asked for
    path = results if results else (None if smoke else record.DEFAULT_RESULTS)
    if write and path:
        record.append(path, rec)
        print(f"[benchmarks] result appended to {path}")
    elif write:
        print("[benchmarks] smoke run: not recorded (--results PATH records it)")
    out = os.environ.get("OUT")
    if out and write:
        record.append(os.path.join(out, "results.jsonl"), rec)
    ok = figures.get("ok") if isinstance(figures, dict) else None
    return 1 if ok is False else 0
