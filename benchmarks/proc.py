"""A child command in its own process group, killed whole at its time limit: the ranks and
workers it spawned must not outlive it holding GPUs."""
from __future__ import annotations

import os
import signal
import subprocess
import threading


def run_group(cmd: list[str], timeout: float, **kw) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); 124 with what it had printed if it ran past timeout.
    stdout / stderr may be given as open files (then "" is returned for them)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    p = subprocess.Popen(cmd, start_new_session=True, text=True, **kw)

    def kill_group():
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(signum, _frame):
        # the child has its own session, so a signal to this process (an outer `timeout`, a
        # Ctrl-C) does not reach it: without this its ranks kept the GPUs busy under the next job
        kill_group()
        raise SystemExit(128 + signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out or "", err or ""
    except subprocess.TimeoutExpired:
        kill_group()
        out, err = p.communicate()
        return 124, out or "", (err or "") + f"\n[benchmarks] killed after {timeout:.0f} s\n"
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
