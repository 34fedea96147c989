"""The run directory's paths: the one place that knows its file names and its folders' names.

    run = RunDir(out)
    run.manifest, run.summary, run.diff_csv      RUN_DIR/manifest.json, summary.json, diff.csv
    run.world("2"), run.world("1-mb2")           RUN_DIR/tp2, RUN_DIR/tp1-mb2 (a configuration's records)
    run.world_file("2", WORLD)                   RUN_DIR/tp2/world.json
    run.own_inputs("2")                          RUN_DIR/own-inputs-tp2.safetensors

A configuration's folder is its name (tpdiag.base.configs: `tp` and compare's key), so the run
directory contract's `tp{N}` for a plain TP run is what it was. Every reader and writer of a run
directory goes through here (tests/test_rundir_paths.py greps tpdiag/ for the literals). Only
os and base: the first checks of a run directory import it.
"""
from __future__ import annotations

import os

from tpdiag.base.configs import folder

MANIFEST = "manifest.json"
SUMMARY = "summary.json"
DIFF_CSV = "diff.csv"
# Where runner/drill.py writes the second pass: ops (op level, float64), region (the values of a
# hash-first run), "-all" when its first positions did not reproduce pass 1, and region/ops (the
# own-input judgement after a hash-first pass)
# runner/drill.py's names: "-all" when the first positions did not reproduce the divergence,
# "-modules" when the ranks' op streams differ (an MoE routing other tokens per rank) and the op pass
# falls back to module level - a genuine run's second pass, never "not one tpdiag writes" (the region
# pass of a hash-first run falls back the same way: region-modules)
SECOND_PASS_DIRS = ("region", "region-all", "ops", "ops-all", "ops-modules", "ops-all-modules", "region-modules",
                    "region-all-modules", "region/ops")
# the reruns' folders inside a run, each a whole run directory of its own: confirm/<fix>,
# auto/round<i>, variants/<slug> (records/nested.py knows them as parts of their run)
CONFIRM_DIR, AUTO_DIR, VARIANTS_DIR = "confirm", "auto", "variants"
REPORT = "report.html"
# the first bytes of every page `tpdiag report` writes: a report.html without them is not tpdiag's
REPORT_MARK = b"<title>tpdiag report"
# a configuration's folder: what its world wrote (records/store.py: events and tensors beside these)
WORLD = "world.json"    # the world's config, fingerprint, selfcheck
RESULT = "result.json"  # the launcher's verdict on the world (runner/launch.py)
EVENTS = "events.jsonl"  # one line per record (records/store.py)
TENSORS = "records.safetensors"  # the records' tensors


def rank_marker(rank: int, what: str) -> str:
    """rankR.done (the rank finished its work) or rankR.error (it failed)."""
    return f"rank{rank}.{what}"


def is_world_folder(name: str) -> bool:
    """A directory name a configuration's records could live under (tp2, tp1-mb2, tp1-base)."""
    return name.startswith("tp")


class RunDir:
    """A run directory by its path; the paths of what lies in it."""

    def __init__(self, path):
        self.path = os.fspath(path)

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def manifest(self) -> str:
        return self.file(MANIFEST)

    @property
    def summary(self) -> str:
        return self.file(SUMMARY)

    @property
    def diff_csv(self) -> str:
        return self.file(DIFF_CSV)

    @property
    def report(self) -> str:
        return self.file(REPORT)

    @staticmethod
    def folder(label) -> str:
        """A configuration's folder name from its compare key: '2' -> 'tp2', '1-mb2' -> 'tp1-mb2'."""
        return folder(label)

    def world(self, label) -> str:
        """RUN_DIR/tp{label}: where a configuration's world writes its records."""
        return self.file(folder(label))

    def world_file(self, label, name: str) -> str:
        return os.path.join(self.world(label), name)

    def own_inputs(self, label) -> str:
        """A configuration's whole inputs and output grads for the local float64 oracle
        (diff/own_inputs.py), written by the second pass beside the folders."""
        return self.file(f"own-inputs-{folder(label)}.safetensors")

    def world_glob(self, pattern: str) -> str:
        """A glob over every configuration's folder: RUN_DIR/tp*/pattern."""
        return os.path.join(self.path, "tp*", pattern)

    # the reruns' run directories inside this one, each a whole run directory of its own
    def confirm_run(self, fix: str) -> str:
        """`tpdiag confirm` / --confirm with one fix: RUN_DIR/confirm/<fix>."""
        return os.path.join(self.path, CONFIRM_DIR, fix)

    def fix_round(self, i: int) -> str:
        """--fix auto's round i >= 1: RUN_DIR/auto/round<i>."""
        return os.path.join(self.path, AUTO_DIR, f"round{i}")

    def second_pass(self, hashed: bool) -> str:
        """The second pass (runner/drill.py): RUN_DIR/region after a hash-first pass, else RUN_DIR/ops."""
        return self.file("region" if hashed else "ops")

    def variant(self, slug: str) -> str:
        """A matrix run's variant (runner/matrix.py): RUN_DIR/variants/<slug>."""
        return os.path.join(self.path, VARIANTS_DIR, slug)


def world_file(world_dir: str, name: str) -> str:
    """A file of one configuration's folder, given the folder (a world's out_dir, a capture)."""
    return os.path.join(os.fspath(world_dir), name)
