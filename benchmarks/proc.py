"""A child command in its own process group, killed whole at its time limit: the ranks and
workers it spawned must not outlive it holding GPUs."""
from __future__ import annotations

import os
import signal
import subprocess


def run_group(cmd: list[str], timeout: float, **kw) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); 124 with what it had printed if it ran past timeout.
    stdout / stderr may be given as open files (then "" is returned for them)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    p = subprocess.Popen(cmd, start_new_session=True, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out or "", err or ""
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return 124, out or "", (err or "") + f"\n[benchmarks] killed after {timeout:.0f} s\n"
