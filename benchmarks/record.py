"""One JSON line per job run: where, on what, with which code and arguments, and the figures."""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = os.path.join(ROOT, "benchmarks", "results.jsonl")


def git_commit() -> str | None:
    """HEAD of this checkout (+ "-dirty" with uncommitted changes); TPDIAG_GIT_COMMIT wins,
    for copies without .git such as the device machine's."""
    env = os.environ.get("TPDIAG_GIT_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Versions and device, read after the job ran (importing triton first would fix the
    interpreter setting before a --smoke job could choose it)."""
    import torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"
                   + (f", {torch.cuda.device_count()} GPUs" if cuda else ""),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__, "triton": triton_v, "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def make_record(job: str, argv: list[str], figures: dict, wall_s: float) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "job": job, "args": list(argv), "smoke": "--smoke" in argv, **environment(),
            "commit": git_commit(), "wall_s": round(wall_s, 3), "figures": figures}


def append(path: str, rec: dict) -> str:
    line = json.dumps(rec, default=str, sort_keys=False)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "a") as f:
        f.write(line + "\n")
    return line


def ingest(src: str, dst: str) -> int:
    """Append the lines of src (e.g. $OUT/results.jsonl fetched from the device machine) that
    dst does not hold yet; returns how many were added."""
    have = set()
    if os.path.exists(dst):
        with open(dst) as f:
            have = {ln.strip() for ln in f if ln.strip()}
    added = 0
    with open(src) as f, open(dst, "a") as out:
        for ln in f:
            ln = ln.strip()
            if not ln or ln in have:
                continue
            json.loads(ln)  # a torn line is not history
            out.write(ln + "\n")
            have.add(ln)
            added += 1
    return added
