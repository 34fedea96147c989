"""One writer per run directory: `compare` and `confirm` hold RUN_DIR/.tpdiag.lock while they write.

An flock on the file, not the file's existence, is the lock: the kernel drops it when its process
ends however it ends, so a killed compare never blocks the next one. The file's content (pid, host,
start time) names the holder for the refusal message; a file whose content survives with no
holder is the trace of a compare that was killed, and the next one says so.
"""
from __future__ import annotations

import json
import os
import platform
import time
from contextlib import contextmanager

from tpdiag.errors import BadInput, Inconclusive

NAME = ".tpdiag.lock"


def _holder(path: str) -> dict:
    try:
        from tpdiag.base import files as io

        with io.open_regular(path, limit=io.LIMIT_SMALL) as f:  # a FIFO planted there must not block
            d = json.loads(f.read(4096) or "{}")
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError, Inconclusive):
        return {}


def _who(h: dict) -> str:
    return f"pid {h.get('pid', '?')} on {h.get('host', '?')}, started {h.get('started', '?')}"


@contextmanager
def hold(run_dir: str, command: str = "compare", unlockable_ok: bool = False):
    """Yields None, or a one-line note when a stale lock (its process gone) was found and taken over.
    Raises BadInput when another live process holds RUN_DIR. unlockable_ok: a file system without
    flock (Lustre mounted without it: ENOSYS) yields None unlocked instead of refusing (tpdiag.capture,
    under the user's own launcher, ran there before it took the lock)."""
    import fcntl

    created = not os.path.isdir(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # read-only, no permission, a file on the way: was "PermissionError: [Errno 1] ..."
        from tpdiag.base.files import why_unwritable

        flag = {"capture": "capture(out=...)", "confirm": "RUN_DIR"}.get(command, "--out")
        why = why_unwritable(os.path.join(run_dir, NAME), e)
        raise BadInput(f"{flag} {run_dir}: cannot create it ({why})") from None
    path = os.path.join(run_dir, NAME)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise BadInput(f"--out {run_dir}: cannot lock it ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise in_use(run_dir, _who(_holder(path))) from None
        except OSError as e:
            os.close(fd)
            if unlockable_ok:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                yield None
                return
            raise BadInput(f"--out {run_dir}: cannot lock it ({e.strerror or e})") from None
        # The holder before us may have unlinked the file between our open and our flock: then we hold
        # a lock on a file nobody else will ever open. Only the file at the path counts.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = _holder(path)
    note = None
    if stale.get("pid") is not None:
        alive = stale.get("host") == platform.node() and _alive(stale["pid"])
        note = (f"{run_dir} had a stale lock ({_who(stale)}; "
                f"{'that pid is alive but no longer holds it' if alive else 'its process is gone'}): "
                "an earlier run was killed there; its files are replaced")
    me = {"pid": os.getpid(), "host": platform.node(), "command": command,
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError as e:
        # a full disk (ENOSPC) or a quota: one line naming the directory, not a bare OSError - and nothing
        # of ours left behind
        for undo in (lambda: os.unlink(path), lambda: os.close(fd)) + ((lambda: os.rmdir(run_dir),) if created else ()):
            try:
                undo()
            except OSError:
                pass
        raise BadInput(f"--out {run_dir}: cannot write its lock file ({e.strerror or e}); "
                       "free some space or use another --out") from None
    try:
        yield note
    finally:
        # Unlink before unlocking: whoever opens the path next creates a new file (see the inode check).
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
        if created:
            try:
                os.rmdir(run_dir)  # made here and nothing was written (refused, or stopped before a world)
            except OSError:
                pass


def in_use(run_dir: str, who: str) -> BadInput:
    return BadInput(f"{run_dir} is in use by another tpdiag run ({who}); wait for it to finish or use another --out")


def refuse_if_held(run_dir: str) -> None:
    """The cheap early check (before torch is imported): refused in a second, not after the imports."""
    who = holder(run_dir) if run_dir else None
    if who:
        raise in_use(run_dir, who)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def holder(run_dir: str) -> str | None:
    """Who holds RUN_DIR's lock now, in words, or None (for the readers: gate, report)."""
    import fcntl

    path = os.path.join(run_dir, NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _who(_holder(path))
    finally:
        os.close(fd)
