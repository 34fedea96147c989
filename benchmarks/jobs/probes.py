"""What the probes cost: step time and peak memory with probes off, in hash mode and in full
mode, and the record hash's throughput against the device's memory bandwidth.

  python -m benchmarks probes overhead --model llama-1b --dtype bfloat16 --seq 2048
  python -m benchmarks probes overhead --model tiny-llama --dtype float32 --batch 1 --seq 16 --rounds 1  # CPU
  python -m benchmarks probes hash          # or hash-sweep: launch shapes side by side (CUDA)
  python -m benchmarks probes launch        # host time per hashed record, by layer (CUDA)
  python -m benchmarks probes profile --model llama-1b --seq 2048   # cProfile: host time hash mode adds
  python -m benchmarks probes profile --kineto --seq 2048           # GPU busy vs step time (CUDA)
  python -m benchmarks probes diff RUN_DIR
  python -m benchmarks probes sass          # the hash loop's sm_90 instruction mix (CPU, no GPU)
  python -m benchmarks probes host --rounds 7   # host time per record, llama-1b structure (CPU)
  python -m benchmarks probes decode-host --seq 256   # probe cost per one-token decode call (CPU)

`overhead`: one training step (forward, loss, backward, clip, AdamW - tpdiag's own step,
runner/step.py) of one model built once, on one device (TP=1), with every module probed
(forward in/out, output grads, parameter grads, parameters before and after). Modes alternate
in rounds after a warm-up round; medians reported (--block K: K steps of a mode back to back,
the last kept; --rest MS: every step but the first starts at least MS after the step before and
its records' gather ended). Peak memory is torch's max allocated over
the step and the records it leaves behind. The records are then gathered as compare would
(to host, composed), timed separately. Beside the ratios: the MFU of the unprobed step
(benchmarks/mfu.py: model FLOPs 6 * N * tokens + causal attention 6 * layers * seq^2 * hidden *
batch, over the GPU's dense bf16 peak; --peak-tflops for other devices).
`hash`: kernels/record_hash.shard_lanes on 1 GiB tensors (whole, and as a last-dim shard),
against torch.sum (a read-only pass: the achievable read bandwidth) and the spec bandwidth.
`diff`: analyse one stored run directory again and report bytes compared per second.
Results go to stdout and, with --out DIR, DIR/probes_*.json. overhead and diff run on CPU too;
the others need CUDA (exit 3 without).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

from benchmarks.errors import require_cuda
from benchmarks.jobs.probes_util import device_name as _device_name
from benchmarks.jobs.probes_util import probe_mode
from benchmarks.mfu import fmt, mfu, peak_flops, step_flops

MODES = ("none", "hash", "full")
EXTRA_MODES = ("hash-each", "hash-jit", "hash-side", "hooks-only", "rows-only", "hash-cap256m", "hash-hooks",
               "wrap-only", "hash-base", "hash-reghook")


def _known_mode(m: str) -> bool:
    m = m.split("@")[0]
    return (m in MODES + EXTRA_MODES or m in ("hash-pairs", "hash-elem")
            or m.startswith(("hash-batch", "hash-waves", "hash-pairs", "hash-iters")) and m[10:].isdigit()
            and int(m[10:]) > 0
            or m.startswith("hash-elem") and m[9:].isdigit() and int(m[9:]) > 0)


def overhead(args) -> dict:
    import torch

    from tpdiag.config import WorldConfig
    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner import determinism, step
    from tpdiag.runner.gather import gather_records

    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    determinism.setup(0, dev_type)
    dev = torch.device(dev_type, 0) if dev_type == "cuda" else torch.device("cpu")
    base = WorldConfig.of(model=args.model, degree=1, label="1", out_dir="", dtype=args.dtype,
                          device=dev_type, batch_size=args.batch, seq_len=args.seq, selfcheck=False)
    built = step.build_model(base, dev, 1)
    step.build_model = lambda cfg, device, world: built  # one model for every mode and round
    nparams = sum(p.numel() for p in built[1].parameters())
    modes = _modes(args.modes)
    res = {m: {"step_s": [], "issue_s": [], "phases": [], "peak_bytes": [], "gather_s": [], "records": 0, "kept_bytes": 0,
               "host": [], "rss_peak": [], "after": [], "mallocs": []} for m in modes}
    last = [None]  # the mode of the step before (warm-ups included)
    ended = [None]  # when the step before ended (perf_counter), for --rest
    import tempfile

    from tpdiag.probes.stream import close_stores

    spill = os.path.join(args.spill_dir or tempfile.gettempdir(), "tpdiag-bench-spill")

    def once(key: str, keep: bool):
        # "MODE@warm": the step starts on the allocator the previous step left - a training loop's
        # steady state, and compare's probed step, which follows the unprobed self-check step in
        # the same process (runner/worker.py: WorldConfig.selfcheck, on in compare); plain MODE:
        # cache emptied first (a process's first step)
        mode, _, alloc = key.partition("@")
        with probe_mode(mode):
            _once(key, mode, alloc, keep)

    def _once(key: str, mode: str, alloc: str, keep: bool):
        rec = Recorder(spill_dir=spill)
        if mode == "none":
            rec.enabled = False
        cfg = base.with_(probes=mode != "none", capture="full" if mode == "full" else "hash")
        if dev_type == "cuda":
            if alloc != "warm":
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        _reset_rss_peak()
        n0 = _device_allocs(dev)
        if args.rest and ended[0] is not None:
            # at least MS of idle GPU before every step, whatever ran before it. Without it the
            # step after a probed one starts after that step's gather (20-35 ms, host work, the
            # GPU idle), the step after an unprobed one at once - and at 8 x 4096 on one H200
            # the unprobed step read 587.7 ms after a hash step and its gather, 595.2 ms after an
            # unprobed step (one job, session 19). The pause counts from the gather's end: a step
            # after a probed one still idles that much longer (with 100 ms: 586.2 / 588.1 ms).
            # The GPU was synchronised when `ended` was stamped, and nothing was queued since.
            time.sleep(max(0.0, args.rest / 1e3 - (time.perf_counter() - ended[0])))
        t = step.run(cfg, dev, 1, rec)
        n1 = _device_allocs(dev)
        after, last[0] = last[0], key
        peak = torch.cuda.max_memory_allocated(dev) if dev_type == "cuda" else 0
        t0 = time.perf_counter()
        # stream: full-mode records stay where the capture put them (host chunks, spill files)
        stored = gather_records(rec.records, dev, lanes=rec.lanes, hashbuf=rec.hashbuf, stream=True)
        gather_s = time.perf_counter() - t0
        host = dict(rec.host_store.stats) if rec.host_store is not None else {}
        rss = _rss_peak()
        close_stores(rec.records, stored)
        if args.rest:
            if dev_type == "cuda":
                torch.cuda.synchronize(dev)
            ended[0] = time.perf_counter()
        import sys

        print(f"[overhead] {key} {'round' if keep else 'warm-up'}: step {1e3 * t['steps_s']:.1f} ms, "
              f"peak {peak / 2**30:.2f} GiB, gather {1e3 * gather_s:.0f} ms, host {host}", file=sys.stderr, flush=True)
        if keep:
            r = res[key]
            r["step_s"].append(t["steps_s"])
            r["issue_s"].append(t["issue_s"])
            # the wait for the GPU after the host issued the step's last work
            r["phases"].append(dict(t.get("phases_s", {}), sync=t["steps_s"] - t["issue_s"]))
            r["peak_bytes"].append(peak)
            r["gather_s"].append(gather_s)
            r["records"] = len(stored)
            r["kept_bytes"] = sum(x.numel() * x.element_size() for _, x in stored if x is not None)
            r["host"].append(host)
            r["rss_peak"].append(rss)
            r["after"].append(after)
            r["mallocs"].append(None if n0 is None else n1 - n0)
        del rec, stored

    for m in modes:  # warm-up: kernels compiled, allocator grown
        once(m, False)
    for k in range(args.rounds):
        # the order changes each round: a hash step run right after an unprobed one read ~10 ms
        # more at 8 x 4096 on an H200 than one after a hash step (session 16), so a fixed order
        # charges that to whichever mode follows the unprobed step. Each probed mode takes that
        # place in turn (_order), and _after_lines reports both places apart. Each round's modes
        # are still paired with that round's unprobed step.
        order = modes if args.fixed_order else _order(modes, k)
        for m in order:
            # --block K: K-1 steps of the same mode first, not kept - the kept step follows its
            # own mode, as every step of a run that is all probed (or all unprobed) does
            for _ in range(args.block - 1):
                once(m, False)
            once(m, True)
    d2h = _d2h_gbs(dev) if dev_type == "cuda" else None
    none_t = statistics.median(res["none" if "none" in res else "none@warm"]["step_s"])
    flops = step_flops(args.model, args.batch, args.seq)
    peak = peak_flops(_device_name() if dev_type == "cuda" else None, args.peak_tflops)
    none_mfu = mfu(flops, none_t, 1, peak)
    out = {"model": args.model, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
           "params": nparams, "device": _device_name(), "rounds": args.rounds, "step_flops": flops,
           "peak_flops": peak, "mfu_no_probes": none_mfu, "d2h_gbs": d2h,
           "host_budget": os.environ.get("TPDIAG_HOST_BUDGET"), "modes": {}}
    for m in modes:
        r = res[m]
        # each against the unprobed step of its own allocator state
        base_r = res["none@warm" if m.endswith("@warm") else "none"]
        none_m = statistics.median(base_r["peak_bytes"]) or 1
        st, pk = statistics.median(r["step_s"]), statistics.median(r["peak_bytes"])
        out["modes"][m] = {"step_ms": 1e3 * st, "issue_ms": 1e3 * statistics.median(r["issue_s"]), "step_spread_ms": 1e3 * (max(r["step_s"]) - min(r["step_s"])),
                           "time_ratio": st / statistics.median(base_r["step_s"]),
                           **_paired(r["step_s"], base_r["step_s"]),
                           "mfu_no_probes": mfu(flops, statistics.median(base_r["step_s"]), 1, peak), "peak_gib": pk / 2**30,
                           "mem_overhead": pk / none_m - 1 if dev_type == "cuda" else None, "gather_ms": 1e3 * statistics.median(r["gather_s"]),
                           "records": r["records"], "kept_mib": r["kept_bytes"] / 2**20,
                           **_host_figures(r, d2h)}
    out["order"] = "fixed" if args.fixed_order else "unprobed first, the probed modes turned each round"
    out["block"], out["rest_ms"] = args.block, args.rest
    if args.block > 1:
        out["order"] += f"; each kept step after {args.block - 1} unkept of its own mode"
    if args.rest:
        out["order"] += (f"; every step but the first started at least {args.rest:g} ms after the step "
                         "before and its records' gather ended")
    lines = [f"overhead: {out['device']}, {args.model} ({nparams / 1e9:.2f}B params) {args.dtype}, "
             f"batch {args.batch} x seq {args.seq}, TP=1, median of {args.rounds} rounds, mode order "
             f"{out['order']}; "
             f"MFU of the unprobed step {fmt(none_mfu)}",
             "| probes | step ms (spread) | x no probes | paired: x (IQR), + ms | MFU no probes | host issue ms | peak GiB | "
             "memory vs no probes | gather ms | records | kept whole MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in out["modes"].items():
        lines.append(f"| {m} | {r['step_ms']:.1f} ({r['step_spread_ms']:.1f}) | {r['time_ratio']:.2f}x | "
                     f"{r['paired_ratio']:.2f}x ({r['paired_ratio_q1']:.2f}-{r['paired_ratio_q3']:.2f}), "
                     f"{r['paired_ms']:+.1f} | "
                     f"{fmt(r['mfu_no_probes'])} | {r['issue_ms']:.1f} | "
                     f"{r['peak_gib']:.2f} | {_pct(r['mem_overhead'])} | {r['gather_ms']:.1f} | "
                     f"{r['records']} | {r['kept_mib']:.1f} |")
    lines += _after_lines(out, res, modes)
    lines += _phase_lines(out, res, modes)
    lines += _host_lines(out, d2h)
    print("\n".join(lines))
    return out


def _order(modes: list, k: int) -> list:
    """Round k's mode order: the unprobed modes first, then the probed ones turned by k - over
    as many rounds as there are probed modes, each runs right after the unprobed step once."""
    none = [m for m in modes if m.startswith("none")]
    probed = [m for m in modes if not m.startswith("none")]
    j = k % max(1, len(probed))
    return none + probed[j:] + probed[:j]


def _device_allocs(dev):
    """cudaMalloc calls so far (the caching allocator's count), or None (CPU, older torch)."""
    if dev.type != "cuda":
        return None
    import torch

    return torch.cuda.memory_stats(dev).get("num_device_alloc")


def _after_lines(out: dict, res: dict, modes: list) -> list[str]:
    """Each probed mode's paired + ms split by the step that ran before it: an unprobed one (what
    compare's probed step follows: the self-check step) or a probed one; and the cudaMalloc calls
    its steps made."""
    lines = ["by the step before (paired + ms, median; rounds; cudaMalloc calls a step, median)",
             "| probes | after an unprobed step | after a probed step |", "|---|---|---|"]
    for m in modes:
        if m.startswith("none"):
            continue
        r = res[m]
        base = res["none@warm" if m.endswith("@warm") else "none"]["step_s"]
        cells = []
        for after_none in (True, False):
            ks = [k for k, a in enumerate(r["after"]) if a is not None and a.startswith("none") == after_none]
            if not ks:
                cells.append("-")
                continue
            d = statistics.median(1e3 * (r["step_s"][k] - base[k]) for k in ks)
            mal = [r["mallocs"][k] for k in ks if r["mallocs"][k] is not None]
            cells.append(f"{d:+.1f} ms ({len(ks)})" + (f", {statistics.median(mal):g} mallocs" if mal else ""))
        out["modes"][m]["after_unprobed_ms"], out["modes"][m]["after_probed_ms"] = cells
        lines.append(f"| {m} | {cells[0]} | {cells[1]} |")
    return lines


def _phase_lines(out: dict, res: dict, modes: list) -> list[str]:
    """Host time by phase of the step (runner/phases.py's marks, timings' phases_s), each mode's paired difference
    from its unprobed step: which phase the probes' cost lands in."""
    names = list(res[modes[0]]["phases"][0]) if res[modes[0]]["phases"] else []
    if not names:
        return []
    lines = ["host ms by phase (median; paired + ms against the unprobed step of the same round)",
             "| probes | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for m in modes:
        base = res["none@warm" if m.endswith("@warm") else "none"]["phases"]
        ph = res[m]["phases"]
        cells, fig = [], {}
        for n in names:
            med = 1e3 * statistics.median(p[n] for p in ph)
            d = 1e3 * statistics.median(p[n] - b[n] for p, b in zip(ph, base))
            fig[n] = {"ms": med, "paired_ms": d}
            cells.append(f"{med:.1f} ({d:+.1f})")
        out["modes"][m]["phases"] = fig
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _paired(steps: list, base: list) -> dict:
    """Each round's step against the same round's unprobed one (modes alternate within a round):
    the host's speed drifts over a run (on the H200 host the unprobed 1 x 2048 step ranged
    69-228 ms in one run), which a ratio of medians carries and a per-round pair mostly cancels."""
    ratios = [a / b for a, b in zip(steps, base)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"paired_ratio": statistics.median(ratios), "paired_ratio_q1": q[0], "paired_ratio_q3": q[2],
            "paired_ms": 1e3 * statistics.median(a - b for a, b in zip(steps, base))}


def _modes(text: str) -> list[str]:
    return [("none" + m[3:]) if m.split("@")[0] == "off" else m for m in text.split(",")]


def _reset_rss_peak() -> None:
    try:  # Linux: '5' resets the process's peak resident set (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_peak() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _d2h_gbs(dev) -> float:
    """Device -> pinned host copy bandwidth, 1 GiB, median of 5: what bounds full capture."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    ts = []
    for _ in range(6):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        y.copy_(x, non_blocking=True)
        torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t)
    del x, y
    return (1 << 30) / statistics.median(ts[1:]) / 1e9


def _host_figures(r: dict, d2h) -> dict:
    hs = r["host"]
    if not hs or not any(hs):
        return {}
    med = lambda k: statistics.median(h.get(k, 0) for h in hs)  # noqa: E731
    copied = med("copied_bytes")
    rss = [x for x in r["rss_peak"] if x is not None]
    return {"captured_gib": med("captured_bytes") / 2**30, "copied_gib": copied / 2**30,
            "spilled_gib": med("spilled_bytes") / 2**30, "host_chunks_peak_gib": med("host_peak_bytes") / 2**30,
            "rss_peak_gib": statistics.median(rss) / 2**30 if rss else None,
            "copy_bound_ms": 1e3 * copied / (d2h * 1e9) if d2h else None}


def _host_lines(out: dict, d2h) -> list[str]:
    rows = [(m, r) for m, r in out["modes"].items() if "captured_gib" in r]
    if not rows:
        return []
    lines = [f"host side (full capture; device->pinned copy {d2h:.1f} GB/s)" if d2h else "host side (full capture)",
             "| probes | GiB captured | GiB copied (once per tensor) | GiB spilled | host chunks peak GiB | "
             "process peak RSS GiB | copied / copy bandwidth ms |", "|---|---|---|---|---|---|---|"]
    for m, r in rows:
        rss = "n/a" if r["rss_peak_gib"] is None else f"{r['rss_peak_gib']:.1f}"
        bound = "n/a" if r["copy_bound_ms"] is None else f"{r['copy_bound_ms']:.0f}"
        lines.append(f"| {m} | {r['captured_gib']:.2f} | {r['copied_gib']:.2f} | {r['spilled_gib']:.2f} | "
                     f"{r['host_chunks_peak_gib']:.2f} | {rss} | {bound} |")
    return lines


def profile_step(args) -> dict:
    """cProfile of an unprobed and a hash-mode training step (TP=1, each after two warm-ups): the
    hash step's top functions, and own time by function, hash minus unprobed - where hash mode's
    host time goes. --kineto (CUDA): torch's profiler instead: the GPU's kernel time beside the
    wall time says whether the step waits on the host or on the GPU."""
    import cProfile
    import io
    import pstats

    import torch

    from tpdiag.config import WorldConfig
    from tpdiag.runner import determinism, step

    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    if args.kineto:
        require_cuda("probes profile --kineto")
    determinism.setup(0, dev_type)
    dev = torch.device(dev_type, 0) if dev_type == "cuda" else torch.device("cpu")
    cfg = WorldConfig.of(model=args.model, degree=1, label="1", out_dir="", dtype=args.dtype, device=dev_type,
                         batch_size=args.batch, seq_len=args.seq, selfcheck=False, capture="hash")
    built = step.build_model(cfg, dev, 1)
    step.build_model = lambda cfg, device, world: built
    if args.kineto:
        return _kineto(args, cfg, dev)
    sync = torch.cuda.synchronize if dev_type == "cuda" else (lambda: None)
    stats, walls, n = {}, {}, 0
    for mode in ("none", "hash"):
        c, rec = _warmed(cfg, dev, mode)
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        step.run(c, dev, 1, rec)
        sync()
        prof.disable()
        walls[mode] = time.perf_counter() - t
        if mode == "hash":
            n = len(rec.records)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue())
        stats[mode] = pstats.Stats(prof).stats
    # own time by function, hash minus none: what hash mode adds to the host's work, by place
    keys = set(stats["none"]) | set(stats["hash"])
    own = lambda m, k: stats[m].get(k, (0, 0, 0.0, 0.0))[2]  # noqa: E731
    rows = sorted(((own("hash", k) - own("none", k), k) for k in keys), reverse=True)[:30]
    print(f"profile: {args.model} {args.dtype} batch {args.batch} seq {args.seq}, {n} records; under cProfile "
          f"the step took {1e3 * walls['none']:.1f} ms unprobed, {1e3 * walls['hash']:.1f} ms in hash mode")
    print("| own ms, hash - none | calls hash / none | function |\n|---|---|---|")
    for d, k in rows:
        calls = f"{stats['hash'].get(k, (0, 0))[1]} / {stats['none'].get(k, (0, 0))[1]}"
        print(f"| {1e3 * d:.2f} | {calls} | {k[2]} {os.path.basename(k[0])}:{k[1]} |")
    return {"records": n, "wall_s": walls, "added_ms": {f"{k[2]} {os.path.basename(k[0])}:{k[1]}": 1e3 * d
                                                        for d, k in rows}}


def _warmed(cfg, dev, mode: str):
    """mode's config ('none' or 'hash') after two warm-up steps, and a fresh recorder for the
    measured one."""
    import torch

    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner import step

    def recorder():
        rec = Recorder()
        rec.enabled = mode != "none"
        return rec

    c = cfg.with_(probes=mode != "none")
    for _ in range(2):
        step.run(c, dev, 1, recorder())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return c, recorder()


def _kineto(args, cfg, dev) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from tpdiag.kernels.hash_buffer import HashBuffer
    from tpdiag.runner import step

    out = {}
    queued = [0]
    enqueue = HashBuffer._enqueue

    def counting(self, chunk, key, item, nbytes):  # bytes queued for hashing in the profiled step
        queued[0] += nbytes
        return enqueue(self, chunk, key, item, nbytes)

    # --modes: the unprobed step and hash-mode variants (probe_mode's), one profiled step each
    for mode in [m for m in _modes(args.modes) if m != "full"] or ["none", "hash"]:
        with probe_mode(mode):
            c, rec = _warmed(cfg, dev, mode)
            queued[0] = 0
            HashBuffer._enqueue = counting
            try:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    t = step.run(c, dev, 1, rec)
            finally:
                HashBuffer._enqueue = enqueue
        ev = prof.key_averages()
        spans = _kernel_spans(prof)
        busy, total = _union(spans), sum(e - b for b, e, _ in spans)
        hash_us = sorted(e - b for b, e, n in spans if "_hash" in n)
        hashed = sum(hash_us)
        out[mode] = {"step_ms": 1e3 * t["steps_s"], "issue_ms": 1e3 * t["issue_s"], "kernels": len(spans),
                     "kernel_ms": total / 1e3, "busy_ms": busy / 1e3, "hash_kernel_ms": hashed / 1e3,
                     "hash_launches": len(hash_us), "queued_gib": queued[0] / 2**30,
                     "hash_gbs": queued[0] / max(hashed, 1e-9) / 1e3}
        print(f"== {mode}: step {1e3 * t['steps_s']:.1f} ms under the profiler (host issued it in "
              f"{1e3 * t['issue_s']:.1f}); {len(spans)} kernels, {total / 1e3:.1f} ms of kernel time, GPU busy "
              f"{busy / 1e3:.1f} ms; hash kernels {hashed / 1e3:.1f} ms ==")
        if hash_us:
            # by launch duration: where the hash kernels' time goes
            cuts = [(0, 10), (10, 100), (100, 1000), (1000, float("inf"))]
            out[mode]["hash_by_us"] = {f"{a}-{b}": [sum(1 for d in hash_us if a <= d < b),
                                                   sum(d for d in hash_us if a <= d < b) / 1e3] for a, b in cuts}
            # (queued bytes only: a mode hashing each record at once - hash-each, hash-jit -
            # queues none; a record found stale after its launch is counted)
            rate = f"{queued[0] / hashed / 1e3:.0f} GB/s over their kernel time" if queued[0] and hashed else \
                "bytes not counted: nothing queued"
            print(f"  {len(hash_us)} hash launches over {queued[0] / 2**30:.2f} GiB queued "
                  f"({rate}); longest "
                  f"{', '.join(f'{d:.0f}' for d in hash_us[::-1][:8])} us; by launch duration (us: launches, ms): "
                  + "; ".join(f"{k}: {n}, {ms:.1f}" for k, (n, ms) in out[mode]["hash_by_us"].items()))
        out[mode]["windows"] = _windows(prof, spans)
        for w, f in out[mode]["windows"].items():
            print(f"  {w}: {f['ms']:.1f} ms, GPU busy {f['busy_ms']:.1f} ms ({f['busy_ms'] / max(f['ms'], 1e-9):.0%}), "
                  f"hash kernels {f['hash_ms']:.1f} ms")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=12))
    return out


def _kernel_spans(prof) -> list:
    """(start us, end us, name) of each device kernel and memcpy/memset in the trace; torch's
    key_averages counts a kernel under its op and again as itself (and GPU user annotations over
    both), so sums are taken over the device events alone."""
    from torch.autograd import DeviceType

    spans = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        spans.append((e.time_range.start, e.time_range.end, e.name))
    return spans


def _windows(prof, spans) -> dict:
    """The trace cut where the autograd engine's first and last backward node ran (on the host):
    before (forward and loss), backward, after (clip, optimizer, parameter records) - each with
    the GPU's busy time inside it: a window near 100% busy is one the GPU paces."""
    from torch.autograd import DeviceType

    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    bw = [e for e in cpu if e.name.startswith("autograd::engine::evaluate_function")]
    if not cpu or not bw or not spans:
        return {}
    t0 = min(e.time_range.start for e in cpu)
    b0, b1 = min(e.time_range.start for e in bw), max(e.time_range.end for e in bw)
    t1 = max(max(e.time_range.end for e in cpu), max(e for _, e, _ in spans))
    out = {}
    for name, (a, b) in (("forward+loss", (t0, b0)), ("backward", (b0, b1)), ("after", (b1, t1))):
        cut = [(max(s, a), min(e, b), n) for s, e, n in spans if e > a and s < b]
        out[name] = {"ms": (b - a) / 1e3, "busy_ms": _union(cut) / 1e3,
                     "hash_ms": sum(e - s for s, e, n in cut if "_hash" in n) / 1e3}
    return out


def _union(spans) -> float:
    busy, end = 0.0, float("-inf")
    for b, e, _ in sorted(spans):
        if e > end:
            busy += e - max(b, end)
            end = e
    return busy


def diff_throughput(args) -> dict:
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.store import RecordSet

    run = args.run_dir
    man = json.load(open(os.path.join(run, "manifest.json")))
    labels = man["labels"]
    ref = RecordSet(os.path.join(run, f"tp{labels[0]}"))
    rows = []
    for lab in labels[1:]:
        d = os.path.join(run, f"tp{lab}")
        nbytes = sum(os.path.getsize(os.path.join(x, "records.safetensors"))
                     for x in (d, os.path.join(run, f"tp{labels[0]}")))
        t0 = time.perf_counter()
        entry, rws = analyse_degree(ref, RecordSet(d), lab)
        t = time.perf_counter() - t0
        rows.append({"degree": lab, "records": len(rws), "mib": nbytes / 2**20, "s": t,
                     "mib_s": nbytes / 2**20 / t, "records_s": len(rws) / t})
    lines = [f"diff throughput: {run} ({man.get('model')}, {man.get('dtype')}), host {os.cpu_count()} CPUs",
             "| degree | records | MiB compared (both sides) | s | MiB/s | records/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['degree']} | {r['records']} | {r['mib']:.0f} | {r['s']:.2f} | {r['mib_s']:.0f} | "
                     f"{r['records_s']:.0f} |")
    print("\n".join(lines))
    return {"run": run, "rows": rows}


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="benchmarks probes", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("overhead", "hash", "hash-sweep", "launch", "profile", "diff", "sass",
                                         "host", "decode-host"))
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3,
                    help="overhead: measured rounds (medians); hash: rounds of every row, interleaved")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="overhead: comma list of none (or off), hash (records queued, many per launch), "
                         "hash-each (a launch per record), hash-jit (a launch per record through "
                         "Triton's JIT dispatch), hash-side (experiment: queued launches on a second stream; "
                         "timings only, its hashes untrusted), hooks-only (Recorder.add returns at once), rows-only "
                         "(records made, nothing hashed), hash-cap256m (a launch per 256 MiB queued, not 1 GiB), hash-batchN (N records a launch, not 64), hash-wavesN (16-bit records at N programs per SM, not 4), hash-pairs[N] (bf16 read as word pairs [at N programs per SM]), hash-elem[N] (bf16 element by element at N (4) programs per SM, shipped before 62cadff), hash-itersN (16-bit chunks of N tiles, not 16), hash-hooks (every module probed through hooks, as before session 13), hash-base (the kernels of PROBES_BASE_KERNEL=FILE, another commit's record_hash_triton.py), hash-reghook (output grads hooked through Tensor.register_hook, before session 18), full; MODE@warm: the step on a warm allocator (no "
                         "empty_cache before it; its ratio against none@warm)")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="spec memory bandwidth (H200: 4800)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak TFLOP/s of one device for MFU (default: 989.4 on H100/H200, else no MFU)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--fixed-order", action="store_true",
                    help="overhead: run the modes in the --modes order every round (default: the "
                         "unprobed mode first, then the probed modes turned by one each round, so each "
                         "runs right after the unprobed step equally often)")
    ap.add_argument("--block", type=int, default=1,
                    help="overhead: steps of one mode back to back, the last kept (default 1: modes "
                         "alternate step by step; K > 1: each kept step follows K-1 of its own mode, "
                         "as in a run that is all probed or all unprobed; with MODE@warm also on the "
                         "allocator such a run leaves)")
    ap.add_argument("--rest", type=float, default=0.0,
                    help="overhead: start every step at least REST ms after the step before and its "
                         "records' gather ended (default 0: at once; then the step after a probed "
                         "one starts on a GPU that idled for that step's gather, the step after an "
                         "unprobed one on a GPU that did not idle)")
    ap.add_argument("--spill-dir", default=None,
                    help="overhead: where full capture spills past TPDIAG_HOST_BUDGET (default: the temp dir)")
    ap.add_argument("--waves", default=None,
                    help="hash: 16-bit variants also at these programs per SM, side by side (e.g. 4,16)")
    ap.add_argument("--shapes", default=None,
                    help="hash-sweep: launch shapes 'BLOCK,ITERS,WAVES,WARPS;...' (default: the job's list)")
    ap.add_argument("--cuda", action="store_true", help="host: the same model on the GPU, wall time")
    ap.add_argument("--kineto", action="store_true",
                    help="profile: torch's profiler over an unprobed and a hash step (GPU vs host time)")
    ap.add_argument("--smoke", action="store_true",
                    help="overhead on tiny-llama fp32, batch 1 x seq 16, 1 round (the code path, on CPU too)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.dtype, args.batch, args.seq, args.rounds = "tiny-llama", "float32", 1, 16, 1
    if not (math.isfinite(args.rest) and args.rest >= 0):
        ap.error(f"--rest must be a finite number of ms >= 0, not {args.rest:g}")
    if args.block < 1:
        ap.error(f"--block must be at least 1, not {args.block}")
    if args.what == "diff" and not args.run_dir:
        ap.error("diff needs RUN_DIR")
    if args.what == "overhead":
        ms = _modes(args.modes)
        bad = [m for m in ms if not _known_mode(m)
               or m.partition("@")[2] not in ("", "warm")]
        if bad:
            ap.error(f"--modes: unknown {', '.join(bad)} (MODE or MODE@warm; MODE one of none, hash, full "
                     "or an experiment --help lists)")
        if any(m.partition("@")[0] == "hash-base" for m in ms):
            from benchmarks.jobs.probes_util import BASE_KERNEL_ENV, base_kernel_path

            if base_kernel_path() is None:  # a missing file is its own one line
                ap.error(f"--modes hash-base needs {BASE_KERNEL_ENV}=FILE (another commit's record_hash_triton.py)")
        for warm in ("", "@warm"):
            if any(m.endswith("@warm") == bool(warm) for m in ms) and "none" + warm not in ms:
                ap.error(f"--modes must include none{warm} (the ratios of the {'@warm' if warm else 'plain'} "
                         "modes are against it)")
    if args.what == "profile" and args.kineto:
        bad = [m for m in _modes(args.modes) if m != "full" and (not _known_mode(m) or "@" in m)]
        if bad:
            ap.error(f"--modes: unknown for profile --kineto: {', '.join(bad)} (none, hash or an experiment "
                     "--help lists; no @warm: each mode's step follows two warm-up steps)")
    from benchmarks.jobs.probes_hash import hash_sweep, hash_throughput, launch_cost
    from benchmarks.jobs.probes_decode import decode_host
    from benchmarks.jobs.probes_host import host
    from benchmarks.jobs.probes_sass import sass

    res = {"overhead": overhead, "hash": hash_throughput, "hash-sweep": hash_sweep, "launch": launch_cost,
           "profile": profile_step, "diff": diff_throughput, "sass": sass, "host": host,
           "decode-host": decode_host}[args.what](args)
    if args.out:
        name = f"probes_{args.what}_{args.model}_{args.dtype}.json" if args.what in ("overhead", "profile") else f"probes_{args.what}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(res, f, indent=1)
    return {"what": args.what, **res}
