"""`tpdiag rollout --jobs N`: the configurations' work in N concurrent worlds per TP degree
(auto: a share of the GPUs' process budget per degree, by its work).

Where the time goes (docs/rl.md): a rollout's configurations are many small forward calls - a
decode step of a 1B model at batch 4 is ~1 ms of GPU work and ~30 ms of the model's Python
(transformers' modules, DTensor dispatch at TP > 1) - so one process leaves the GPU idle and
one CPU core busy. The work splits without changing any number: a configuration's micro-batches
are independent (each starts its own KV cache), so a unit is (configuration, the sequences of
whole micro-batches [lo, hi)), and units go to lanes - worlds of the unit's degree, a TP=1 lane
a world of one rank - that run side by side, each with the model built once. The lanes spread
over the GPUs (a TP=1 lane on GPU k mod n, a TP=t lane's ranks on t consecutive GPUs), and under
--jobs auto every degree gets lanes - TP > 1 too: on 2 H200s (1012b3a) its one world, 8 TP=1 lanes
on GPU 0 beside its rank 0, ran 96 s of the rollout's 116 s.

Same bits as one process because every lane runs the same code on the same shapes under the
same state: the model built as TP=1 builds it (runner.build.build_model at world 1 = compute.build),
each configuration under its own flags (flags.applied), every lane started under the first
configuration's setting as the in-process run and the single world are (the cuBLAS workspace is
fixed by the process's first GEMM), the in-process run's CPU thread count, and the same tree
groups. tests/test_rollout_lanes.py holds every configuration's logprobs torch.equal to the
single-process path's.
"""
from __future__ import annotations

import time

from tpdiag.base.configs import folder


def split(cfgs, seqs, lanes: int) -> list[tuple]:
    """(config, lo, hi) units: a configuration whole, or - when there are lanes to fill - cut at
    micro-batch boundaries into up to `lanes` pieces of about equal cost."""
    out = []
    for c in cfgs:
        bounds = list(range(0, len(seqs), c.micro_batch)) + [len(seqs)]
        mbs = list(zip(bounds, bounds[1:]))
        pieces = min(lanes, len(mbs))
        costs = [cost(c, seqs, a, b) for a, b in mbs]
        total = sum(costs)
        lo, acc, made = 0, 0.0, 0
        for i, ((a, b), w) in enumerate(zip(mbs, costs)):
            acc += w
            left = len(mbs) - i - 1  # micro-batches after this one
            # close the piece at the boundary nearest its share; enough micro-batches stay for the rest
            if b == len(seqs) or left == pieces - made - 1 or acc >= total * (made + 1) / pieces - w / 2:
                out.append((c, lo, b))
                lo, made = b, made + 1
    return out


def cost(c, seqs, lo: int, hi: int) -> float:
    """Forward calls: one per micro-batch in prefill; in decode its prompt call and one per step."""
    n = 0.0
    for a in range(lo, hi, c.micro_batch):
        group = seqs[a:min(a + c.micro_batch, hi)]
        n += 1 + (max(s.n_generated for s in group) - 1 if c.mode == "decode" else 0)
    return n


# A call's relative host time, for balancing only (no number depends on it): on an H200 (dfe0339)
# a decode call under a fix took ~1.9x a stock one (Triton launches, the invariant attention's
# mode). A TP=2 call took about a TP=1 call's time where both shared GPU 0 (2 H200s, 1012b3a:
# micro-batch 1 decode under the fixes 43.3 s at TP=2, 47.5 s at TP=1; micro-batch 4 10.8 vs
# 15.3 s), so a TP=2 lane's work weighs the same - and takes a process on each of its GPUs
FIX_WEIGHT = 2.0
# stock SDPA on CUDA runs cuDNN's attention (PyTorch's default flags on an H200), which builds a
# graph the first time a process meets a shape - every decode step is a new KV length: on an H200
# (dfe0339) 128 batch-4 decode calls took 8.6 s under PyTorch's defaults (cuDNN) and 2.7 s under
# the deterministic flags (flash) - ~1.5 stock calls a step, the first decode configuration's
# other first-time costs included (not measured apart); each lane that runs a piece pays it
GRAPH_WEIGHT = 1.5


def weight(c) -> float:
    return FIX_WEIGHT if c.fix != "none" else 1.0


def unit_cost(c, seqs, lo: int, hi: int, device: str = "cpu") -> float:
    """A unit's expected time in stock TP=1 calls: its calls by weight(c), and on CUDA, for a stock
    decode under PyTorch's flags, the per-process set-up of each decode step's new shape (once per
    lane, whatever the number of sequences it runs: the shapes repeat across micro-batches)."""
    w = weight(c) * cost(c, seqs, lo, hi)
    if device == "cuda" and c.mode == "decode" and c.fix == "none" and c.flags == "default" \
            and c.attention in ("auto", "sdpa", "sdpa-cudnn"):
        w += GRAPH_WEIGHT * max(s.n_generated for s in seqs[lo:hi])
    return w


def assign(units, lanes: int) -> list[list]:
    """Longest first onto the least loaded lane; each lane keeps the units' run order."""
    order = {id(u): i for i, u in enumerate(units)}
    loads = [[0.0, []] for _ in range(max(1, lanes))]
    for u in sorted(units, key=lambda u: -u[3]):
        lane = min(loads, key=lambda x: x[0])
        lane[0] += u[3]
        lane[1].append(u)
    return [sorted(ls, key=lambda u: order[id(u)]) for _, ls in loads if ls]


def lanes_per_degree(rc, cfgs, seqs) -> dict[int, int]:
    """{TP degree: concurrent worlds}: --jobs N gives every degree N; auto is 1 on the CPU (its
    cores are what the ranks already use) and, on CUDA, shares a budget of processes per GPU
    between the degrees in proportion to their work (auto_budget)."""
    degrees = list(dict.fromkeys(c.tp for c in cfgs))
    if rc.jobs > 0:
        return {t: rc.jobs for t in degrees}
    if rc.device != "cuda":
        return {t: 1 for t in degrees}
    gpus, per_gpu = auto_budget(rc)
    work = {t: sum(unit_cost(c, seqs, 0, len(seqs), rc.device) for c in cfgs if c.tp == t) for t in degrees}
    units = {t: sum(-(-len(seqs) // c.micro_batch) for c in cfgs if c.tp == t) for t in degrees}
    return share(work, units, gpus * per_gpu)


def share(work: dict, units: dict, slots: int) -> dict[int, int]:
    """Lanes per degree: one each, then one more at a time to the degree whose work per lane is
    the largest, while a TP=t lane's t processes (one per GPU it spans) fit in `slots` and the
    degree has units left to give it."""
    n = {t: 1 for t in work}
    used = sum(t * k for t, k in n.items())
    while True:
        open_ = [t for t in work if n[t] < units[t] and used + t <= slots and work[t] > 0]
        if not open_:
            return n
        t = max(open_, key=lambda d: (work[d] / n[d], -d))
        n[t] += 1
        used += t


def run(rc, seqs, cfgs, counts: dict, work: str, groups: int, threads: int, on_status=None, cancel=None,
        launches=None) -> dict:
    """{label: {'status', 'logprobs' | 'reason', 'seconds', 'sdpa_ran', 'flag_values'}} of every
    configuration in `cfgs` (any degrees), computed in counts[t] concurrent worlds of each degree t
    (lanes_per_degree), the lanes spread over the GPUs (placement). cancel: ends every world now;
    launches: told how many worlds start, then of each start (tpdiag.rollout.early.Launches)."""
    from concurrent.futures import ThreadPoolExecutor

    from tpdiag.rollout.world import run_degree, unit_key

    start_flags = rc.flags[0]  # what the in-process TP=1 and each single world start under
    gpus = _gpu_count(rc)
    plan = []  # (degree, lane index, [(config, lo, hi)])
    for t in dict.fromkeys(c.tp for c in cfgs):
        n = counts.get(t, 1)
        units = [(c, lo, hi, unit_cost(c, seqs, lo, hi, rc.device))
                 for c, lo, hi in split([c for c in cfgs if c.tp == t], seqs, n)]
        for k, lane in enumerate(assign(units, n)):
            plan.append((t, k, [u[:3] for u in lane]))
    # longest lanes first: the pool starts every lane at once, but their processes start in order
    plan.sort(key=lambda item: -sum(unit_cost(c, seqs, lo, hi, rc.device) for c, lo, hi in item[2]))

    def one(item):
        t, k, units = item
        if on_status:
            on_status(f"{folder(t)} lane {k}", "running")
        t0 = time.perf_counter()
        res = run_degree(t, rc, seqs, list(dict.fromkeys(u[0] for u in units)), work, groups, units=units,
                         lane=k, threads=threads if t == 1 else 1, flags=start_flags,
                         first_gpu=placement(t, k, gpus), cancel=cancel,
                         on_launch=launches.one if launches is not None else None)
        if on_status:
            on_status(f"{folder(t)} lane {k}", f"done in {time.perf_counter() - t0:.1f} s")
        return res

    pieces: dict = {}
    if launches is not None:
        launches.expect(len(plan))
    with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
        for res in pool.map(one, plan):
            pieces.update(res)
    out = {}
    for c in cfgs:
        keys = [unit_key(c.rollout_name(), lo, hi) for (_, _, units) in plan for (u, lo, hi) in units if u == c]
        keys.sort(key=lambda k: int(k.rsplit("@", 1)[1].split(":")[0]))
        parts = [pieces.get(k, {"status": "failed", "reason": "no result"}) for k in keys]
        bad = next((p for p in parts if p["status"] != "ok"), None)
        entry = {"seconds": round(sum(p.get("seconds") or 0.0 for p in parts), 3),
                 "sdpa_ran": _add([p.get("sdpa_ran") or {} for p in parts])}
        if bad is not None:
            entry.update(status=bad["status"], reason=bad.get("reason"))
        else:
            entry.update(status="ok", logprobs=[x for p in parts for x in p["logprobs"]],
                         flag_values=parts[0].get("flag_values"))
        out[c.rollout_name()] = entry
    return out


def _add(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def placement(degree: int, lane: int, gpus: int) -> int:
    """The GPU of a lane's rank 0 (rank r on GPU first + r): the lanes round-robin over the GPUs, so
    each GPU holds about as many processes. Every lane runs the same kernels on any GPU of
    one machine's identical GPUs - the cuBLAS heuristics, Triton's compiled code and cuDNN's plans
    follow the device's architecture and SM count, which are the same."""
    first = (lane * degree) % max(1, gpus)
    return first if first + degree <= gpus else 0  # a world's ranks on distinct GPUs (NCCL's rule)


def auto_budget(rc) -> tuple[int, int]:
    """(GPUs, processes per GPU) for --jobs auto on CUDA. The processes are CPU-bound (the model's
    Python) and the GPU mostly idle, but processes on one GPU share it by time slicing: on an H200
    4 TP=1 lanes ran their work 3.5x as fast as one process (dfe0339), 8 lanes beside a TP=2 rank
    3.8x (1012b3a) - so one process per 3 CPU cores of the GPU's share, at most 6 a GPU, and no
    more than fit (each counted as the whole checkpoint + 3 GiB, a TP=1 lane's need)."""
    import os

    gpus = _gpu_count(rc)
    per_gpu = max(1, min(6, (os.cpu_count() or 4) // gpus // 3))
    weights = _weight_bytes(rc.model)
    if weights:
        try:
            import torch

            total = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        except Exception:  # noqa: BLE001 - no device to ask: the CPU-count rule alone
            return gpus, per_gpu
        per_gpu = max(1, min(per_gpu, int(0.7 * total // (weights + (3 << 30)))))
    return gpus, per_gpu


def _gpu_count(rc) -> int:
    if rc.device != "cuda":
        return 1
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - every lane on the one device there is
        return 1


def _weight_bytes(model: str) -> int:
    """An hf: checkpoint's weight files' size (0: not known)."""
    import glob
    import os

    if not model.startswith("hf:"):
        return 0
    files = [f for ext in ("*.safetensors", "*.bin", "*.pt") for f in glob.glob(os.path.join(model[3:], ext))]
    return sum(os.path.getsize(f) for f in files)
