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


# GPU bytes a world's CUDA context, NCCL buffers and allocator slack take beyond its measured peak
_CONTEXT_BYTES = 2 << 30


def pair_gpu(device: str, ref_cfg, other_cfg, first: str | None) -> int | None:
    """The GPU the reference may run on beside the one other world of a pass (a second pass's region
    worlds, runner/drill.py), or None: one after the other.

    Why it may: the other world then reads nothing the reference writes - whole records (no hash
    shard placed by the reference's shapes: worker._ref_shapes), prefill of one step at one micro-batch
    (no piece by the reference's pieces, no anchored state), and no parameter that is no replica
    (gather's per-rank blocks read the reference's parameter shapes), which the pass-1 world of its
    label wrote in world.json (`first`: pass 1's run directory). Each world's bits are its own step's
    (deterministic kernels give the same bits whoever else runs on the GPU), and the region pass
    checks each world's step fingerprint against pass 1's (drill_merge: step_differs) either way.
    The GPUs must be of one kind and hold both worlds' pass-1 peaks; the reference takes the first
    GPU past the other world's where there is one, else the last of them (not rank 0's: it gathers
    and writes). TPDIAG_SIDE_BY_SIDE=0: never; =force: on the host too (a test hook)."""
    knob = os.environ.get("TPDIAG_SIDE_BY_SIDE", "1")
    if knob == "0" or first is None or ref_cfg.degree != 1:
        return None
    for c in (ref_cfg, other_cfg):
        if c.capture != "full" or c.micro_batch or c.mode != "prefill" or c.steps != 1:
            return None
    from tpdiag.base import files as io
    from tpdiag.records.paths import WORLD, RunDir
    from tpdiag.records.rundir import read_manifest

    try:
        seen = io.read_json(RunDir(first).world_file(other_cfg.label, WORLD))
        worlds = read_manifest(first)["worlds"]
    except Exception:  # noqa: BLE001 - no pass-1 world to learn from: one after the other
        return None
    if not isinstance(seen, dict) or seen.get("per_rank_params") != 0:
        return None  # a world.json from before the field, or a model with per-rank parameters
    if device != "cuda":
        return 0 if knob == "force" else None
    peaks = []
    for label in (ref_cfg.label, other_cfg.label):
        t = ((worlds.get(label) or {}).get("timings") or {}) if isinstance(worlds, dict) else {}
        vals = [t.get(k) for k in ("peak_mem_bytes", "selfcheck_peak_mem_bytes")]
        vals = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not vals:
            return None
        peaks.append(max(vals))
    import torch

    try:
        n = torch.cuda.device_count()
        if n < other_cfg.degree:
            return None
        props = [torch.cuda.get_device_properties(i) for i in range(n)]
    except Exception:  # noqa: BLE001 - no answer: one after the other
        return None
    kinds = {(p.name, p.major, p.minor, p.total_memory, p.multi_processor_count) for p in props}
    if len(kinds) != 1:
        return None
    gpu = other_cfg.degree if n > other_cfg.degree else n - 1
    # a GPU shared with a rank of the other world holds both; the full capture keeps its records on
    # the host, so each world's pass-1 peak is its peak here, and a quarter more is left spare
    need = peaks[0] + (peaks[1] if gpu < other_cfg.degree else 0)
    return gpu if need * 1.25 + 2 * _CONTEXT_BYTES <= props[gpu].total_memory else None


def run_beside(ref_cfg, other_cfg, timeout_s: float, on_status, gpu: int):
    """(reference's WorldResult, the other world's WorldResult, the reference's GPU or None): both at
    once, the reference on GPU `gpu` in a thread. A world that failed beside the other (out of memory
    there) runs again alone after both, where it would have run before (the reference on GPU 0);
    its GPU is then None."""
    from tpdiag.runner.launch import run_world

    box: dict = {}
    cancel = threading.Event()

    def reference():
        try:
            box["res"] = run_world(ref_cfg, timeout_s, on_status, cancel=cancel, gpu_offset=gpu)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["err"] = e

    t = threading.Thread(target=reference, name="tpdiag-ref-side", daemon=True)
    t.start()
    try:
        other = run_world(other_cfg, timeout_s, on_status)
        t.join()  # in the try: an interrupt while the reference runs on cancels its ranks
    except BaseException:
        cancel.set()
        t.join()
        raise
    if "err" in box:
        raise box["err"]
    ref = box["res"]
    if ref.status != "ok":
        ref, gpu = run_world(ref_cfg, timeout_s, on_status), None
    if other.status != "ok":
        other = run_world(other_cfg, timeout_s, on_status)
    return ref, other, gpu
