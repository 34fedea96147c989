"""Where a step's GPU sits idle: the device timeline of a torch.profiler chrome trace.

A step can be slower than stock while its kernels take no longer (fix-cost at TP=4: the fixes'
CUDA time below stock's, the step 1.25x slower). Then the time is in gaps between kernels -
host work the GPU waits for, or a sync. This reads one trace and says, for the stream that does
the most work: the window from its first to its last kernel, busy time (the union of kernel
intervals on every stream), idle time, and the largest gaps with the host op that was running
(innermost cpu_op on the launching thread) when each gap began.

    python -m benchmarks.trace_gaps TRACE.json[.gz] [--top 15]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def analyse(events: list[dict], top: int = 15) -> dict:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    start, end = busy[0][0], busy[-1][1]
    busy_us = sum(b - a for a, b in busy)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    # host ops per thread, to name what ran while the device waited
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    by_tid = defaultdict(list)
    for e in cpu:
        by_tid[e.get("tid")].append(e)
    main_tid = max(by_tid, key=lambda t: len(by_tid[t])) if by_tid else None
    host = sorted(by_tid.get(main_tid, []), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]

    def running_at(ts: float) -> str:
        i = bisect.bisect_right(starts, ts)
        best = None
        for e in reversed(host[max(0, i - 400):i]):  # the innermost op spanning ts
            if e["ts"] <= ts <= e["ts"] + e["dur"] and (best is None or e["dur"] < best["dur"]):
                best = e
        return best["name"] if best else "-"

    by_op: dict[str, float] = defaultdict(float)
    for a, b in gaps:
        by_op[running_at(a)] += b - a
    big = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    kern = defaultdict(float)
    for e in gpu:
        kern[e["name"][:60]] += e["dur"]
    return {"window_ms": (end - start) / 1e3, "busy_ms": busy_us / 1e3,
            "idle_ms": (end - start - busy_us) / 1e3, "gaps": len(gaps),
            "gaps_over_50us_ms": sum(b - a for a, b in gaps if b - a > 50) / 1e3,
            "idle_by_host_op_ms": {k: round(v / 1e3, 2) for k, v in
                                   sorted(by_op.items(), key=lambda kv: -kv[1])[:top]},
            "largest_gaps": [{"at_ms": round((a - start) / 1e3, 2), "ms": round((b - a) / 1e3, 3),
                              "host_op": running_at(a)} for a, b in big],
            "kernels_ms": {k: round(v / 1e3, 2) for k, v in sorted(kern.items(), key=lambda kv: -kv[1])[:top]}}


def render(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name}: {r['error']}"
    lines = [f"{name}: device window {r['window_ms']:.1f} ms, busy {r['busy_ms']:.1f} ms, idle "
             f"{r['idle_ms']:.1f} ms in {r['gaps']} gaps ({r['gaps_over_50us_ms']:.1f} ms in gaps > 50 us)",
             "  idle by the host op running when the gap began (ms): " +
             ", ".join(f"{k} {v}" for k, v in r["idle_by_host_op_ms"].items()),
             "  largest gaps: " + ", ".join(f"{g['ms']} ms at {g['at_ms']} ({g['host_op']})"
                                            for g in r["largest_gaps"][:8]),
             "  kernels (ms): " + ", ".join(f"{k} {v}" for k, v in list(r["kernels_ms"].items())[:8])]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    print(render(a.trace, analyse(load(a.trace), a.top)))


if __name__ == "__main__":
    main()
