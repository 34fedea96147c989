"""The one writer of a run directory's summary.json and manifest.json.

Each pass returns its part (the diff its summary, a world its result, the session its timings,
the fix chain its rounds) and the caller assembles the file in memory and writes it whole through
here - after each part, so an interrupted run leaves the parts so far as a valid file (the
manifest from the first world on, the summary from the first pass's diff on), as the gate and
the report expect. No pass reads either file back to patch it; tests/test_run_files.py fails on
a write of either anywhere else in tpdiag/.
"""
from __future__ import annotations

from tpdiag.base import files as io
from tpdiag.records.paths import RunDir

IN_MEMORY = ("run_dir",)  # what a summary carries for its caller, never written


_KINDS = {"tpdiag compare": "a tpdiag compare run", "tpdiag diff": "a tpdiag diff output",
          "tpdiag.capture": "a tpdiag.capture directory"}


def check_out(out: str, tool: str, flag: str = "--out") -> None:
    """Refuse, before anything runs, an output directory whose contents the command would lose:
    a file, or a directory whose manifest.json is not an earlier run of this same tool - a compare
    run (`tpdiag diff --out RUN_DIR` replaced a compare's manifest and summary with the diff's), a
    capture (capture() unlinks the manifest it finds), or a manifest.json tpdiag did not write.
    An earlier run of the same tool is replaced, as README says of compare."""
    import os

    from tpdiag.errors import BadInput

    if not os.path.lexists(out):
        up = os.path.dirname(os.path.abspath(out))
        while up and not os.path.lexists(up):
            up = os.path.dirname(up)
        if up and not os.path.isdir(up):  # found before the run, not at its first write
            raise BadInput(f"{flag} {out}: cannot create it ({up} is a file, not a directory)")
        return
    if not os.path.isdir(out):
        raise BadInput(f"{flag} {out!r}: exists and is not a directory")
    mpath = RunDir(out).manifest
    if not os.path.lexists(mpath):
        run = RunDir(out)
        # no manifest.json: no run of ours (compare writes it first). A compare wrote its summary.json
        # and diff.csv over the user's own files there, and removed their report.html (hhouse23); an
        # earlier `tpdiag report` page (its mark in its first bytes) is stale and goes, as in a run
        mine = [p for p in (run.summary, run.diff_csv) if os.path.lexists(p)]
        if os.path.lexists(run.report) and not _marked(run.report):
            mine.append(run.report)
        if tool == "tpdiag compare" and mine:
            raise BadInput(f"{flag} {out!r}: holds {os.path.basename(mine[0])} but no manifest.json (not a tpdiag "
                           f"run); this {tool} would write over it: name a new directory (or move that one away)")
        return
    try:
        m = io.read_json(mpath)
    except Exception:  # noqa: BLE001 - unreadable: not an earlier run of ours either
        m = None
    kind = m.get("tool") if isinstance(m, dict) else None
    if kind == tool:
        return
    what = (f"{_KINDS[kind]}; this {tool} would replace its manifest.json" if kind in _KINDS else
            f"a manifest.json that no tpdiag run wrote; this {tool} would replace it")
    raise BadInput(f"{flag} {out!r}: holds {what}: name a new directory (or move that one away)")


def write_summary(run_dir, summary: dict) -> dict:
    """summary.json: the summary as assembled so far, less its in-memory keys; returns what it
    wrote (a later part is added to that, not to a copy read back)."""
    written = {k: v for k, v in summary.items() if k not in IN_MEMORY}
    io.write_json(RunDir(run_dir).summary, written)
    return written


def drop_stale_report(run_dir) -> None:
    """A compare into an earlier run's directory replaces its files; `tpdiag report`'s page of
    that run would stay beside them, showing the old verdict as this run's. Only tpdiag's own
    page goes: any other file of the user's there is not tpdiag's to delete."""
    import os

    report = RunDir(run_dir).report
    if os.path.isfile(report):
        os.unlink(report)


def write_manifest(run_dir, manifest: dict) -> None:
    """manifest.json, whole (a command that writes it once: diff, capture, a matrix)."""
    io.write_json(RunDir(run_dir).manifest, manifest)


class RunFiles:
    """A compare's manifest.json and summary.json, assembled from their parts. The manifest: the
    run's head (versions, config, environment), each world's result, then the diff's phases and
    status and the session's timings - every part written at once, the whole file each time.
    The summary: `summary()` writes one and keeps what it wrote (`written`) for the next part."""

    def __init__(self, run_dir, head: dict):
        self.run_dir, self.manifest, self.written = RunDir(run_dir), dict(head), None
        write_manifest(self.run_dir, self.manifest)

    def world(self, label: str, part: dict) -> None:
        """A world's result (its status, wall time, timings, numerics)."""
        self.manifest.setdefault("worlds", {})[label] = part
        write_manifest(self.run_dir, self.manifest)

    def add(self, **parts) -> None:
        """Top-level parts of the manifest, set or replaced in place of the same key (its order kept)."""
        self.manifest.update(parts)
        write_manifest(self.run_dir, self.manifest)

    def summary(self, summary: dict) -> dict:
        self.written = write_summary(self.run_dir, summary)
        return self.written


def _marked(path: str) -> bool:
    """A page `tpdiag report` wrote (records.paths.REPORT_MARK in its first 4 KiB); unreadable: not."""
    from tpdiag.records.paths import REPORT_MARK

    try:
        with open(path, "rb") as f:
            return REPORT_MARK in f.read(4096)
    except OSError:
        return False
