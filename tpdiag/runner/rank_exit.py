"""How a rank process ends: `os._exit`, never the interpreter's teardown - gloo/NCCL destructors
are where ranks abort or hang - after unlinking the named semaphores the rank made.

A rank is a forkserver child, so a `multiprocessing` lock made in it is a named semaphore
registered with the launcher's resource tracker, and only its finalizer (run at a normal exit)
unlinks it. tqdm makes one the first time any bar is built (torch.fx's interpreter builds one
under torch.compile: `--compiled`); skipped by `os._exit`, it stayed behind in /dev/shm and the
tracker printed "leaked semaphore objects" under the user's command."""
from __future__ import annotations

import os
import sys


def leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _unlink_semaphores()
    os._exit(code)


def _unlink_semaphores() -> None:
    try:
        from multiprocessing import synchronize, util

        registry = util._finalizer_registry  # the finalizers a normal exit would run
        for fin in [f for f in list(registry.values()) if getattr(f, "_callback", None) is synchronize.SemLock._cleanup]:
            fin()
    except Exception:  # noqa: BLE001 - leaving must never fail; the cost is a warning
        pass
