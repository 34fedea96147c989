"""Read a run directory's verdict files (manifest.json, summary.json, diff.csv) for report and gate."""
from __future__ import annotations

import csv
import os

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
# RunDir: importable from here too (the run directory's readers and its paths side by side)
from tpdiag.records.paths import DIFF_CSV, MANIFEST, SUMMARY, RunDir, is_world_folder  # noqa: F401

# diff.csv's columns, in order: the diff engine writes one row per compared record and degree.
ROW_FIELDS = ["degree", "idx", "key", "step", "phase", "module", "kind", "call", "name", "cls",
              "style", "layout", "dtype", "shape", "bitwise", "rank_consistent", "max_abs",
              "max_rel", "max_ulp", "mismatch_fraction", "bound", "beyond_bound"]

_INT = ("idx", "step", "call", "max_ulp")
_FLOAT = ("max_abs", "max_rel", "mismatch_fraction", "bound")
_BOOL = ("bitwise", "rank_consistent", "beyond_bound")


def run_file(run_dir: str, name: str) -> str:
    """RUN_DIR/name, refused when a symlink takes it out of the run directory (a verdict file must be
    the run's own, not /etc/passwd or another run's)."""
    path = os.path.join(run_dir, name)
    real, root = os.path.realpath(path), os.path.realpath(run_dir)
    if os.path.islink(path) and os.path.commonpath([real, root]) != root:
        raise Inconclusive(f"{path}: a symlink out of the run directory (to {real}); refused")
    return path


def read_manifest(run_dir: str) -> dict:
    """manifest.json: versions, config, degrees, per-world status (written first by compare)."""
    return io.read_json(run_file(run_dir, MANIFEST))


def read_summary(run_dir: str) -> dict:
    """summary.json: the verdict (schema 1)."""
    return io.read_json(run_file(run_dir, SUMMARY))


def _parse_row(r: dict) -> dict:
    out = dict(r)
    for k in _INT:
        out[k] = int(float(r[k])) if r.get(k) not in (None, "") else None
    for k in _FLOAT:
        out[k] = float(r[k]) if r.get(k) not in (None, "") else None
    for k in _BOOL:
        out[k] = {"True": True, "False": False}.get(r.get(k))
    return out


def read_rows(path: str) -> list[dict]:
    """diff.csv as typed dicts; a missing or malformed file is Inconclusive, never half-read."""
    try:
        with io.open_regular(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ROW_FIELDS if c not in (reader.fieldnames or [])]
            if missing:
                raise Inconclusive(f"{path}: not a tpdiag diff.csv (missing columns {', '.join(missing[:4])})")
            return [_parse_row(r) for r in reader]
    except FileNotFoundError:
        raise Inconclusive(f"{path}: missing") from None
    except (ValueError, KeyError, UnicodeDecodeError, csv.Error, OverflowError) as e:
        what = f"not UTF-8 at byte {e.start}" if isinstance(e, UnicodeDecodeError) else str(e).splitlines()[0][:200]
        raise Inconclusive(f"{path}: corrupt ({what})") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise Inconclusive(f"{path}: unreadable ({e.strerror or e})") from None


def incomplete(run_dir: str, manifest) -> str | None:
    """Why a compare's run directory is not a finished run, or None. `tpdiag compare` writes
    manifest.json first and gives it its final `status` last: without one the compare was
    interrupted, killed or is still running, and any summary.json there is from an earlier run."""
    foreign = not_a_run(run_dir, manifest)
    if foreign:
        return foreign
    # Keyed on `tool` only to say which words fit: a manifest edited to another tool is still checked
    # as a compare by records/integrity.py (a tool other than "tpdiag compare" is itself a problem).
    if isinstance(manifest, dict) and manifest.get("tool") == "tpdiag compare" and "status" not in manifest:
        worlds = manifest.get("worlds") if isinstance(manifest.get("worlds"), dict) else {}
        done = ", ".join(f"TP={k} {(v or {}).get('status') if isinstance(v, dict) else v}" for k, v in worlds.items())
        from tpdiag.records.lock import holder

        who = holder(run_dir)
        if who:
            return f"{run_dir}: a compare is still running there ({who}); worlds finished: {done or 'none'}"
        return (f"{run_dir}: incomplete run - the compare did not finish (interrupted, killed or still "
                f"running; worlds finished: {done or 'none'})")
    return None


RUN_TOOLS = ("tpdiag compare", "tpdiag diff")


def not_a_run(run_dir: str, manifest) -> str | None:
    """One line where manifest.json is not a run directory's at all: a capture of `tpdiag.capture` (the
    input of `tpdiag diff`), another tool's manifest.json, or no JSON object. Before this a capture given
    to the gate or the report read `CAPTURE/summary.json: missing`, which says nothing of what to do."""
    if not isinstance(manifest, dict):
        return f"{run_dir}/manifest.json: not a JSON object (not a tpdiag run directory)"
    tool = manifest.get("tool")
    if tool == "tpdiag.capture":
        return (f"{run_dir}: a capture of tpdiag.capture, not a run directory; compare two captures with "
                "`tpdiag diff CAPTURE_A CAPTURE_B --out DIR`, then read DIR")
    if "tool" in manifest and tool not in RUN_TOOLS:
        return (f"{run_dir}/manifest.json: written by {tool!r}, not by {' or '.join(RUN_TOOLS)} (not a tpdiag run "
                "directory)")
    return None


def is_diff_dir(run_dir: str, manifest) -> bool:
    """A `tpdiag diff` output, whose records are the two captures its manifest names (outside it, by
    design). Known by its shape as well as its `tool`: no worlds and no tp{label} folder of its own,
    so a compare run whose manifest is edited to say "tpdiag diff" is still checked as a compare."""
    if not isinstance(manifest, dict) or manifest.get("tool") != "tpdiag diff" or "worlds" in manifest:
        return False
    try:
        return not any(is_world_folder(n) and os.path.isdir(os.path.join(run_dir, n)) for n in os.listdir(run_dir))
    except OSError:
        return False


def records_dir(run_dir: str, manifest: dict, label: str) -> str:
    """Where a degree's records live: RUN_DIR/tp{label} for compare (or a matrix run's variant folder
    inside it), the capture itself for `tpdiag diff`. A relative path is the run directory's, never the
    caller's working directory; a compare's records never lie outside its run directory (a `runs`
    entry or a symlinked tp{label} pointing at another run's records is Inconclusive)."""
    runs = manifest.get("runs") if isinstance(manifest, dict) else None
    path = RunDir(run_dir).world(label)
    if isinstance(runs, dict) and isinstance(runs.get(label), str):
        path = os.path.join(run_dir, runs[label])  # an absolute entry stays absolute
    if is_diff_dir(run_dir, manifest):
        return path
    real, root = os.path.realpath(path), os.path.realpath(run_dir)
    if os.path.commonpath([real, root]) != root:
        raise Inconclusive(f"{run_dir}: the records of TP={label} resolve to {real}, outside the run "
                           "directory (an edited manifest.json 'runs' entry or a symlinked folder); refused")
    return path


def load_run(run_dir: str) -> tuple[dict, dict, list[dict]]:
    from tpdiag.records.check import require_run_dir

    require_run_dir(run_dir)
    manifest = read_manifest(run_dir)
    why = incomplete(run_dir, manifest)
    if why:
        raise Inconclusive(why)
    summary = read_summary(run_dir)
    if not isinstance(summary, dict) or not isinstance(summary.get("degrees"), dict):
        raise Inconclusive(f"{RunDir(run_dir).summary}: no 'degrees' table (not a tpdiag summary)")
    if not isinstance(manifest, dict):
        raise Inconclusive(f"{RunDir(run_dir).manifest}: not a JSON object")
    return manifest, summary, read_rows(run_file(run_dir, DIFF_CSV))


def bitwise_keys(run_dir: str, label: str) -> set[str]:
    """The records of configuration `label` bitwise equal (and rank-consistent) in a run's
    diff.csv; empty when it has none."""
    path = RunDir(run_dir).diff_csv
    if not os.path.exists(path):
        return set()
    return {r["key"] for r in read_rows(path) if r["degree"] == label and r["bitwise"] is True
            and r.get("rank_consistent") is not False}
