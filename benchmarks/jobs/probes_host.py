"""`python -m benchmarks probes host`: the probes' host time per record, on CPU, without a GPU.

llama-1b's module structure (16 layers, the same modules, parameters and records a step) at
tiny widths, in fp32 on CPU, with hash mode's device work replaced by nothing: records are
queued as on CUDA (HashBuffer, batch_entry, launch tables) but the launch does not run. What is
left is what a host-bound step (llama-1b at batch 1 x seq 2048 on an H200: MFU ~8%) pays per
record on top of the unprobed step: hooks, Recorder.add, queueing, grad hooks, parameter
records. Step CPU times (process time, one torch thread: a shared host disturbs it far less
than wall time) alternate none / hash in rounds (median, spread); then one hash step under
cProfile (top functions by own time; PROBES_HOST_SORT=cumtime). Host-only figures: they say
nothing about device time. --cuda: the same model on the GPU, its launches run, wall time: what
the host pays per record beside real (tiny) kernels, the autograd engine's device thread and the
launch tables included.
"""
from __future__ import annotations

import gc
import os
import time


SORT = os.environ.get("PROBES_HOST_SORT", "tottime")


def host(args) -> dict:
    from tpdiag.config import WorldConfig
    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner import step

    from benchmarks.jobs.probes_util import host_model, profiled_medians

    cuda = getattr(args, "cuda", False)
    dev = host_model(cuda, "probes host --cuda")
    base = WorldConfig.of(model="llama-1b", degree=1, label="1", out_dir="", dtype="float32",
                          device="cuda" if cuda else "cpu", batch_size=1, seq_len=16, selfcheck=False)
    # hash-gc: Python's cyclic GC left on during the probed step (TPDIAG_PROBE_GC=1), the A/B of
    # module_probes' GC pause; hooks-only / rows-only as in `probes overhead`
    times: dict = {"none": [], "hash": [], "hash-gc": [], "hash-hooks": [], "hooks-only": [], "rows-only": []}
    gen2 = {m: 0 for m in times}
    records = 0
    current = ["none"]

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            gen2[current[0]] += 1

    from benchmarks.jobs.probes_util import probe_mode

    # on CUDA: wall time (the autograd engine runs the backward, hooks included, on a thread
    # of its own, whose CPU time process time would add to the main thread's)
    clock = time.perf_counter if cuda else time.process_time

    def once(mode: str):
        rec = Recorder()
        rec.enabled = mode != "none"
        cfg = base.with_(probes=mode != "none", capture="hash")
        os.environ["TPDIAG_PROBE_GC"] = "1" if mode == "hash-gc" else "0"
        current[0] = mode
        with probe_mode(mode):
            t = clock()
            step.run(cfg, dev, 1, rec)  # synchronises the device at its end
            t = clock() - t
        current[0] = "other"
        os.environ.pop("TPDIAG_PROBE_GC")
        return t, rec

    for m in times:  # warm-up
        once(m)
    gen2["other"] = 0
    gc.callbacks.append(count)
    for _ in range(args.rounds):
        for m in times:
            t, rec = once(m)
            times[m].append(t)
            if m == "hash":
                records = len(rec.records)
    gc.callbacks.remove(count)
    profile, med, spread = profiled_medians(once, times, SORT)
    per_us = {m: 1e6 * (med[m] - med["none"]) / max(records, 1) for m in times}
    where = ("CUDA, hash launches run, wall time" if cuda else "CPU, hash launches not run, process time")
    print(f"probes host: llama-1b structure at tiny widths, fp32, batch 1 x seq 16, {where}; median of "
          f"{args.rounds} rounds; hash-gc = Python's GC left on in the probed step; hash-hooks = every module "
          "probed through hooks (as before session 13); hooks-only = "
          "Recorder.add returning at once; rows-only = records made, nothing hashed")
    print("| probes | step ms (spread) | x none | records | host us per record (vs none) | full GC "
          "collections in these steps |\n|---|---|---|---|---|---|")
    for m in times:
        print(f"| {m} | {1e3 * med[m]:.1f} ({1e3 * spread[m]:.1f}) | {med[m] / med['none']:.2f}x | "
              f"{0 if m == 'none' else records} | {'' if m == 'none' else f'{per_us[m]:.1f}'} | {gen2[m]} |")
    print(profile)
    return {"rounds": args.rounds, "records": records, "device": "cuda" if cuda else "cpu", "other_full_collections": gen2["other"],
            "clock": "wall" if cuda else "process",
            "modes": {m: {"step_ms": 1e3 * med[m], "spread_ms": 1e3 * spread[m], "x_none": med[m] / med["none"],
                          "host_us_per_record": per_us[m], "full_collections": gen2[m]} for m in times}}
