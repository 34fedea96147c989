"""The reference world and its rerun side by side, each on its own GPU of one kind.

Why: the rerun (the determinism baseline: the reference's step again, in fresh processes) reads
nothing the reference writes - at TP=1 no shard is placed by the reference's shapes, and outside
micro-batch and decode no piece by its pieces (runner/worker.py _ref_shapes, _piece_ref) - so where a
second GPU of the same kind sits idle during the reference it need not wait for it (llama-1b
1 x 2048 on 2x H200: the rerun was 1.9-2.4 s after the reference's 2.2-6.7 s). Two GPUs of one
model run the same kernels on the same inputs to the same bits; a rerun whose bits differ there
is a reproducibility failure the user needs to hear of either way, and the world entry says on
which GPU each ran. A rerun that fails beside the reference (the second GPU busy with another job:
out of memory) runs again on GPU 0 after it, as it did before this. TPDIAG_SIDE_BY_SIDE=0: one
after the other (A/B); =force: on the host too (a test hook).
"""
from __future__ import annotations

import os
import threading


def side_gpu(device: str, ref_cfg, base_cfg) -> int:
    """The GPU offset the rerun may run on beside the reference (1), or 0: after it, on GPU 0."""
    knob = os.environ.get("TPDIAG_SIDE_BY_SIDE", "1")
    if knob == "0" or ref_cfg.degree != 1 or base_cfg.degree != 1 or base_cfg.micro_batch \
            or base_cfg.mode == "decode":
        return 0
    if device != "cuda":
        # the test hook: two gloo worlds at once on the host (a GPU offset means nothing there)
        return 1 if knob == "force" else 0
    import torch

    try:
        if torch.cuda.device_count() < 2:
            return 0
        a, b = (torch.cuda.get_device_properties(i) for i in (0, 1))
    except Exception:  # noqa: BLE001 - no answer: the old order
        return 0
    same = (a.name, a.major, a.minor, a.total_memory, a.multi_processor_count) == \
        (b.name, b.major, b.minor, b.total_memory, b.multi_processor_count)
    return 1 if same else 0


def run_pair(ref_cfg, base_cfg, timeout_s: float, on_status, offset: int):
    """(reference's WorldResult, rerun's WorldResult, the rerun's GPU offset): both at once, the
    rerun on GPU `offset` in a thread; a rerun that failed there runs again on GPU 0 after."""
    from tpdiag.runner.launch import run_world

    box: dict = {}
    cancel = threading.Event()

    def rerun():
        try:
            box["res"] = run_world(base_cfg, timeout_s, on_status, cancel=cancel, gpu_offset=offset)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["err"] = e

    t = threading.Thread(target=rerun, name="tpdiag-rerun-side", daemon=True)
    t.start()
    try:
        ref = run_world(ref_cfg, timeout_s, on_status)
        # in the try too: a Ctrl-C or SIGTERM (raised here as KeyboardInterrupt) while the rerun
        # runs on would leave its ranks to a daemon thread that exits without reaping them
        t.join()
    except BaseException:
        cancel.set()  # interrupted: the rerun's ranks are killed too
        t.join()
        raise
    if "err" in box:
        raise box["err"]
    base = box["res"]
    if base.status != "ok" and ref.status == "ok":
        base = run_world(base_cfg, timeout_s, on_status)
        offset = 0
    return ref, base, offset
