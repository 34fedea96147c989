"""`tpdiag.load(run_dir)`: a finished run directory as DataFrames (records/frames.py), after the
checks `tpdiag report` runs (diff/evidence.py): a run whose files disagree - an edited summary or
manifest, a missing or symlinked world, records that no longer re-diff to diff.csv - is
Inconclusive, never a frame that reads as the run's result."""
from __future__ import annotations


def load(run_dir: str, check: bool = True):
    """RUN_DIR as a `Run` of DataFrames. A missing directory is BadInput; an unfinished run, or one
    whose evidence disagrees with itself, Inconclusive (the first problem named, and how many more).
    check=False skips the evidence check (its re-diff reads every record: seconds to minutes on a
    large run) - for a run directory you wrote yourself and have not moved or edited."""
    import os

    from tpdiag.errors import Inconclusive
    from tpdiag.records.frames import read, rows_of

    run = read(run_dir)
    if check:
        from tpdiag.diff.evidence import problems

        found = problems(run_dir, run.manifest, run.summary, rows_of(run.records))
        if found:
            more = f" (and {len(found) - 1} more: tpdiag report lists them)" if len(found) > 1 else ""
            raise Inconclusive(f"{os.path.abspath(run_dir)}: inconclusive, the evidence disagrees: {found[0]}{more}")
    return run
