"""Where a rank's exception came from: the user's own file:line, and the saved tracebacks.

A model's bug surfaces deep inside torch (an IndexError in cross_entropy, a shape error in a
matmul); the frame that matters is the innermost one in the user's code - not tpdiag's, torch's,
transformers' or the standard library's.
"""
from __future__ import annotations

import glob
import os
import traceback

from tpdiag.base.user_code import internal_dirs as _internal_dirs
from tpdiag.base.user_code import shown as _shown


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


def _model_frame(frames) -> str | None:
    """The innermost frame in a transformers model file ('transformers/models/X/modeling_X.py')."""
    model = [f for f in frames if f"{os.sep}models{os.sep}" in f.filename and "transformers" in f.filename]
    if not model:
        return None
    m = model[-1]
    return f"{_short(m.filename)}:{m.lineno} in {m.name}"


def library_where(exc: BaseException, message: str) -> tuple[str, str | None]:
    """(message, model frame) of an exception raised in library code (no user frame): an
    empty message (a bare `assert` in torch) becomes where it was raised; the model frame is
    the innermost Hugging Face model line that led there - a model that cannot run under its
    own TP plan fails inside torch, and the model's line is what says why."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return message or "(no message)", None
    if not message:
        last = frames[-1]
        message = f"(no message) at {_short(last.filename)}:{last.lineno} in {last.name}"
    return message, _model_frame(frames) or _backward(frames)


MIXED = "got mixed torch.Tensor and DTensor"


def mixed_hint(message: str) -> str:
    """DTensor's refusal of a plain tensor beside a DTensor, with where such DTensors come from in a
    compare: a `Target.loss` runs inside torch's `loss_parallel()` at TP > 1, so code written for
    plain logits meets a vocab-sharded DTensor and F.cross_entropy's replicated DTensor loss there
    (label smoothing's own masked_fill, a z-loss added to that loss: tests/models/user_tt25.py)."""
    if MIXED not in message:
        return message
    return (f"{message} (a DTensor - a plan output with use_local_output=False, the loss F.cross_entropy "
            "returns under loss_parallel(), where a Target.loss runs at TP > 1 - met a plain tensor: "
            "gather the DTensor with .full_tensor() first)")


def _backward(frames) -> str | None:
    """'the backward pass' where autograd's engine raised it: no frame of anyone's code is on the
    stack there (the op is the backward of one the forward ran), so without it the line says
    nothing of where - a loss-parallel logsumexp's backward mixing DTensor and Tensor read as a
    bare torch error (tests/models/user_tt25.py zloss)."""
    if any(f.name == "_engine_run_backward" or (f.name == "backward" and f"{os.sep}autograd{os.sep}" in f.filename)
           for f in frames):
        return ("the backward pass: loss.backward() ran the backward of an op of the forward or the loss; "
                "under torch.autograd.set_detect_anomaly(True) torch warns with its forward line")
    return None


def describe(err: dict) -> str:
    """One line for a rank's error marker: 'TYPE at FILE:LINE in FUNC: message' when the
    error came from the user's code, 'TYPE (from transformers/models/.../modeling_X.py:LINE in
    FUNC): message' when a Hugging Face model's code led to it, else 'TYPE: message'."""
    where, model = err.get("where"), err.get("model_where")
    head = (f"{err['type']} at {where}" if where else
            f"{err['type']} (from {model})" if model else err["type"])
    return f"{head}: {err['message']}"


def rank_tracebacks(run_dir: str) -> list[tuple[str, int, str]]:
    """(world label, rank, traceback) of every rank error marker of a run directory."""
    from tpdiag.base import files as io
    from tpdiag.base.configs import key
    from tpdiag.records.paths import RunDir

    out = []
    for path in sorted(glob.glob(RunDir(run_dir).world_glob("rank*.error"))):
        label = key(os.path.basename(os.path.dirname(path)))
        try:
            rank = int(os.path.basename(path)[4:].split(".")[0])
            tb = io.read_json(path).get("traceback") or ""
        except Exception:  # noqa: BLE001 - an unreadable marker: nothing to show
            continue
        out.append((label, rank, tb))
    return out
