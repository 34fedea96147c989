"""One line for 'this is not a run directory', shared by report, gate and confirm, naming the
command that makes one. Only os and the typed errors: the gate and the readers call it first."""
from __future__ import annotations

import os

from tpdiag.errors import BadInput
from tpdiag.records.paths import RunDir

MAKE = "make one with: tpdiag compare --out DIR"


def require_run_dir(path: str) -> None:
    """BadInput unless `path` is a directory holding manifest.json (what tpdiag compare writes first)."""
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is a file"
        raise BadInput(f"RUN_DIR {path!r}: not a directory ({what}); expected the --out directory of "
                       f"tpdiag compare ({MAKE})")
    if not os.path.isfile(RunDir(path).manifest):
        raise BadInput(f"RUN_DIR {path!r}: not a run directory (no manifest.json); {MAKE}")
