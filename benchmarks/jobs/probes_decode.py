"""`python -m benchmarks probes decode-host`: a decode world's probe cost per one-token call.

A decode world (`--mode prefill,decode`) runs the prompt in one call, then one token per call:
1,024 calls at 1 x 2048, each filing ~28 records a layer as positions [t, t+1) of the prefill
reference's records (probes/pieces.py). The calls are host-bound (llama-1b on an H100: ~26 ms a
call unprobed), so what the probes add per call is host time: hooks, Recorder.add's piece path,
placement, queueing. llama-1b's module structure (16 layers) at tiny widths, fp32, batch 1;
the prefill reference's record shapes give the pieces their places, as the worker's do. On CPU
hash mode's launches are not run (host work only, process time); --cuda: the GPU, launches run,
wall time. Modes alternate in rounds (none, hash); medians; then one hash world under cProfile.
"""
from __future__ import annotations

import os
import time


SORT = os.environ.get("PROBES_HOST_SORT", "tottime")


def decode_host(args) -> dict:
    from tpdiag.config import WorldConfig
    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner import decode as dec
    from tpdiag.runner import step

    from benchmarks.jobs.probes_util import host_model, probe_mode, profiled_medians

    cuda = getattr(args, "cuda", False)
    dev = host_model(cuda, "probes decode-host --cuda")
    seq = args.seq if args.seq else 128
    base = WorldConfig.of(model="llama-1b", degree=1, label="1", out_dir="", dtype="float32",
                          device="cuda" if cuda else "cpu", batch_size=1, seq_len=seq, selfcheck=False,
                          backward=False, capture="hash")
    ref = Recorder()
    step.run(base, dev, 1, ref)
    piece_ref = {m["key"]: list(m.get("full_shape") or m["local_shape"]) for m, _ in ref.records}
    calls = 1 + seq - dec.default_prompt_len(seq)
    clock = time.perf_counter if cuda else time.process_time
    # hooks-only: Recorder.add returning at once; rows-only: records made, nothing queued
    times: dict = {"none": [], "hooks-only": [], "rows-only": [], "hash": []}
    records = [0]

    def once(mode: str):
        rec = Recorder(piece_ref=piece_ref)
        rec.enabled = mode != "none"
        cfg = base.with_(mode="decode", probes=mode != "none")
        with probe_mode(mode):
            t = clock()
            step.run(cfg, dev, 1, rec)
            t = clock() - t
        if mode == "hash":
            records[0] = len(rec.records)
        return t

    for m in times:
        once(m)
    for _ in range(args.rounds):
        for m in times:
            times[m].append(once(m))
    profile, med, spread = profiled_medians(once, times, SORT)
    per_call = {m: 1e6 * (med[m] - med["none"]) / calls for m in times}
    where = "CUDA, hash launches run, wall time" if cuda else "CPU, hash launches not run, process time"
    print(f"probes decode-host: llama-1b structure at tiny widths, fp32, a decode world of 1 x {seq} "
          f"({calls} calls), {where}; median of {args.rounds} rounds")
    print(f"hash: {records[0]} records (merged); hooks-only = Recorder.add returning at once; rows-only = "
          "records made, nothing queued or hashed")
    print("| probes | world ms (spread) | x none | host us per call (vs none) |\n|---|---|---|---|")
    for m in times:
        extra = "" if m == "none" else f"{per_call[m]:.0f}"
        print(f"| {m} | {1e3 * med[m]:.1f} ({1e3 * spread[m]:.1f}) | {med[m] / med['none']:.2f}x | {extra} |")
    print(profile)
    return {"rounds": args.rounds, "seq": seq, "calls": calls, "records": records[0],
            "device": "cuda" if cuda else "cpu", "clock": "wall" if cuda else "process",
            "modes": {m: {"world_ms": 1e3 * med[m], "spread_ms": 1e3 * spread[m], "x_none": med[m] / med["none"],
                          "host_us_per_call": per_call[m]} for m in times}}
