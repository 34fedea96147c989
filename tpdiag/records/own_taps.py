"""The taps an own-input file names: the children whose output grads the diff reads from a float64
backward (diff/own_inputs.taps), written by runner/drill_own.own_files into the file's safetensors
metadata and read by the reference world's module probe (probes/module_probe.py)."""
from __future__ import annotations

import json


def taps_named(paths) -> set | None:
    """The union of the files' `taps`; None (tap every child) where a file names none."""
    from safetensors import safe_open

    got: set = set()
    for path in paths:
        with safe_open(path, "pt") as f:
            names = (f.metadata() or {}).get("taps")
        if names is None:
            return None
        got |= set(json.loads(names))
    return got
