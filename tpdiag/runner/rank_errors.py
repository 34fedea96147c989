"""Where a rank's exception came from: the user's own file:line, and the saved tracebacks.

A model's bug surfaces deep inside torch (an IndexError in cross_entropy, a shape error in a
matmul); the frame that matters is the innermost one in the user's code - not tpdiag's, torch's,
transformers' or the standard library's.
"""
from __future__ import annotations

import glob
import os
import sysconfig
import traceback

_INTERNAL: list = []


def _internal_dirs() -> list[str]:
    if not _INTERNAL:
        import torch

        import tpdiag

        dirs = [os.path.dirname(tpdiag.__file__), os.path.dirname(torch.__file__)]
        try:
            import importlib.util

            spec = importlib.util.find_spec("transformers")
            if spec is not None and spec.origin:
                dirs.append(os.path.dirname(spec.origin))
        except (ImportError, ValueError):
            pass
        for key in ("stdlib", "platstdlib"):
            p = sysconfig.get_paths().get(key)
            if p:
                dirs.append(p)
        _INTERNAL.extend(os.path.realpath(d) + os.sep for d in dirs)
    return _INTERNAL


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def user_frame(exc: BaseException) -> str | None:
    """'FILE:LINE in FUNC' of the innermost traceback frame outside tpdiag/torch/transformers
    and the standard library; None when every frame is internal (a tpdiag or torch problem)."""
    internal = _internal_dirs()
    found = None
    for fs in traceback.extract_tb(exc.__traceback__):
        f = fs.filename
        if f.startswith("<") or any(os.path.realpath(f).startswith(d) for d in internal):
            continue
        found = f"{_shown(f)}:{fs.lineno} in {fs.name}"
    return found


def _short(path: str) -> str:
    """A library file as 'torch/...' or 'transformers/...' (the part after site-packages)."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return _shown(path)


def silent_where(exc: BaseException) -> str:
    """For an exception with no message (a bare `assert`/`raise AssertionError` in a library):
    where it was raised, and the innermost model frame that led there, so the one line still
    says something ('at torch/.../placement_types.py:1703 in _reduce_value, from
    transformers/models/inkling/modeling_inkling.py:114 in forward')."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "(no message)"
    last = frames[-1]
    out = f"(no message) at {_short(last.filename)}:{last.lineno} in {last.name}"
    model = [f for f in frames[:-1] if f"{os.sep}models{os.sep}" in f.filename
             and "transformers" in f.filename]
    if model:
        m = model[-1]
        out += f", from {_short(m.filename)}:{m.lineno} in {m.name}"
    return out


def describe(err: dict) -> str:
    """One line for a rank's error marker: 'TYPE at FILE:LINE in FUNC: message' when the
    error came from the user's code, else 'TYPE: message'."""
    where = err.get("where")
    head = f"{err['type']} at {where}" if where else err["type"]
    return f"{head}: {err['message']}"


def rank_tracebacks(run_dir: str) -> list[tuple[str, int, str]]:
    """(world label, rank, traceback) of every rank error marker of a run directory."""
    from tpdiag import io

    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "tp*", "rank*.error"))):
        label = os.path.basename(os.path.dirname(path))[2:]
        try:
            rank = int(os.path.basename(path)[4:].split(".")[0])
            tb = io.read_json(path).get("traceback") or ""
        except Exception:  # noqa: BLE001 - an unreadable marker: nothing to show
            continue
        out.append((label, rank, tb))
    return out
