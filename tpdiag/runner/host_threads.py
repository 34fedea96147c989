"""The launcher's own CPU threads (the process that runs `tpdiag compare`, its diff and judgement).

A CPU world's ranks run one thread each (runner/determinism.py: the same count in every world, so
a CPU GEMM's blocking, and so its bits, is the same at every degree). The launcher is another
matter: torch gives it a thread per core, and on a CPU compare its work is the diff of small
records (bit tests, dtype casts, norms), which a parallel region barely speeds up while the
largest world's ranks hold the cores (docs/suite-time.md has the measurements: OMP_NUM_THREADS=1
saves more than this setting, made after start-up, does). Its thread count changes no record's
bits: the records are the ranks'; the launcher compares them bit for bit.
"""
from __future__ import annotations

import os

# a user's own choice of thread count, which tpdiag leaves as it is
USER_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def launcher_threads(device: str, degrees, environ=None) -> int | None:
    """The launcher's intra-op threads for a compare of `degrees` on `device` (cpu, cuda, auto),
    or None: left to torch's default or the user's OMP_NUM_THREADS / MKL_NUM_THREADS. On a CPU
    the cores are shared with the largest world's ranks: max(1, cores // its degree)."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in USER_VARS):
        return None
    from tpdiag.models.capacity import guess_device

    if guess_device(device, degrees) != "cpu":
        return None  # GPU ranks leave the host's cores to the launcher: large records, torch's default
    return max(1, cores() // max(degrees))


def apply(device: str, degrees) -> int | None:
    """Set the launcher's threads (launcher_threads); returns the count set, or None."""
    n = launcher_threads(device, degrees)
    if n is not None:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    return n
