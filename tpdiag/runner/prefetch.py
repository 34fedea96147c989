"""Imports compare's own process needs only after its first worlds, begun while they run.

Why: this process mostly waits while a world runs (runner/launch.py polls its ranks' markers), and
the first diff then imports pandas (records/frames.py: diff.csv is written from its records frame)
on the critical path: 0.5-1.0 s on a 2-core host. Begun in a thread when the first world starts, it
is done by the time the diff needs it, wherever the host has a core the ranks leave free (a GPU
host's ranks wait on their GPUs). Only third-party modules no rank-launching code imports: a
thread importing a module the main thread is importing at the same time waits on that module's
lock, and two threads importing each other's modules could see a partly initialised one.
TPDIAG_PREFETCH=0: none (the A/B).
"""
from __future__ import annotations

import os
import sys
import threading

MODULES = ("pandas",)
_started = threading.Lock()
_thread: threading.Thread | None = None


def start() -> threading.Thread | None:
    """The importing thread (None: nothing left to import, off, or begun already in this process).
    Not a daemon: an exit during the import waits for it rather than stopping it half-done."""
    global _thread
    if os.environ.get("TPDIAG_PREFETCH", "1") == "0":
        return None
    todo = [m for m in MODULES if m not in sys.modules]
    with _started:
        if _thread is not None or not todo:
            return None
        _thread = threading.Thread(target=_load, args=(todo,), name="tpdiag-prefetch")
        _thread.start()
        return _thread


def _load(names) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the diff imports it again and reports what fails there
            pass
