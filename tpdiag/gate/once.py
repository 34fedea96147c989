"""One gate, each record pair measured once and each stored tensor hash-checked once.

Why: the gate re-derives what it judges from the records (docs/security.md) - the first pass's
rows (diff/recheck.verify), each confirmation's (diff/overrides.py), every second-pass folder
(diff/recheck_pass.py) - and those re-diffs read the same bytes again: a confirmation's and a
second pass's reference reruns the reference's step, its worlds are links of the first pass's,
so most of their pairs hold the same content as a pair measured a moment before. Without this a
llama-1b bf16 1 x 2048 gate took longer than the compare whose run it gated.

What is shared is what the compare already shares between its region diff and its own-input
diff (runner/session.py): diff/pair_memo.py's measures, looked up by the pair's stored hashes and
index entries only after both tensors were read and checked against those hashes, and
records/checked.py's checks, by the file's identity (device, inode, size, times). An edited file
fails its check before any lookup and is hashed again (another identity); nothing is carried
from one gate to the next (the blocks end with evaluate). On a host where the compare would
hash and diff on GPU 0 the gate does the same (records/hashing.checks_on, diff/on_device.py:
the same arithmetic, TPDIAG_CHECK_DEVICE=cpu keeps it on the host).

TPDIAG_GATE_ONCE=0: no shared measures or checks, the host only (the old path, the A/B)."""
from __future__ import annotations

import contextlib
import os


def on() -> bool:
    return os.environ.get("TPDIAG_GATE_ONCE", "1") != "0"


def _device():
    """GPU 0 where the compare's parent would use it (runner/session._check_device's rule for a run
    on GPUs); None: the host."""
    if os.environ.get("TPDIAG_CHECK_DEVICE", "auto") == "cpu" or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from tpdiag.base.gpu_shared import shareable

    return "cuda:0" if shareable(0) else None


@contextlib.contextmanager
def session():
    if not on():
        yield
        return
    from tpdiag.diff import pair_memo

    with pair_memo.read_once(_device()):
        yield
