"""Why a job could not run here; the entry point turns these into one line and an exit code."""
from __future__ import annotations


class NeedsCuda(Exception):
    """The job measures or checks something only a CUDA device has (exit 3)."""

    def __init__(self, job: str, hint: str = ""):
        super().__init__(f"{job} needs CUDA (no CUDA device here)" + (f"; {hint}" if hint else ""))


class JobUnavailable(Exception):
    """A registered job whose module is not in this checkout, or cannot run here (exit 3)."""


def require_cuda(job: str, hint: str = "") -> None:
    import torch

    if not torch.cuda.is_available():
        raise NeedsCuda(job, hint)
