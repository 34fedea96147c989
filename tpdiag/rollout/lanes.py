"""`tpdiag rollout --jobs N`: the configurations' work in N concurrent worlds per TP degree.

Where the time goes (docs/rl.md): a rollout's configurations are many small forward calls - a
decode step of a 1B model at batch 4 is ~1 ms of GPU work and ~30 ms of the model's Python
(transformers' modules, DTensor dispatch at TP > 1) - so one process leaves the GPU idle and
one CPU core busy. The work splits without changing any number: a configuration's micro-batches
are independent (each starts its own KV cache), so a unit is (configuration, the sequences of
whole micro-batches [lo, hi)), and units go to lanes - worlds of the unit's degree, a TP=1 lane
a world of one rank - that run side by side, each with the model built once.

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


def assign(units, lanes: int) -> list[list]:
    """Longest first onto the least loaded lane; each lane keeps the units' run order."""
    order = {id(u): i for i, u in enumerate(units)}
    loads = [[0.0, []] for _ in range(max(1, lanes))]
    for u in sorted(units, key=lambda u: -u[3]):
        lane = min(loads, key=lambda x: x[0])
        lane[0] += u[3]
        lane[1].append(u)
    return [sorted(ls, key=lambda u: order[id(u)]) for _, ls in loads if ls]


def lanes_of(rc, degree: int, jobs: int) -> int:
    """Lanes for one degree: --jobs N for every degree; auto's N for TP=1 only - TP > 1 keeps one
    world (its worlds side by side would share GPUs between NCCL communicators of different
    processes, whose collectives then wait on the GPUs' time slicing: unmeasured, so not by default)."""
    return jobs if rc.jobs > 0 or degree == 1 else 1


def run(rc, seqs, cfgs, jobs: int, work: str, groups: int, threads: int, on_status=None) -> dict:
    """{label: {'status', 'logprobs' | 'reason', 'seconds', 'sdpa_ran', 'flag_values'}} of every
    configuration in `cfgs` (any degrees), computed in lanes of up to `jobs` worlds per degree."""
    from concurrent.futures import ThreadPoolExecutor

    from tpdiag.rollout.world import run_degree, unit_key

    start_flags = rc.flags[0]  # what the in-process TP=1 and each single world start under
    plan = []  # (degree, lane index, [(config, lo, hi)])
    for t in dict.fromkeys(c.tp for c in cfgs):
        n = lanes_of(rc, t, jobs)
        units = [(c, lo, hi, cost(c, seqs, lo, hi)) for c, lo, hi in split([c for c in cfgs if c.tp == t], seqs, n)]
        for k, lane in enumerate(assign(units, n)):
            plan.append((t, k, [u[:3] for u in lane]))

    def one(item):
        t, k, units = item
        if on_status:
            on_status(f"{folder(t)} lane {k}", "running")
        t0 = time.perf_counter()
        res = run_degree(t, rc, seqs, list(dict.fromkeys(u[0] for u in units)), work, groups, units=units,
                         lane=k, threads=threads if t == 1 else 1, flags=start_flags)
        if on_status:
            on_status(f"{folder(t)} lane {k}", f"done in {time.perf_counter() - t0:.1f} s")
        return res

    pieces: dict = {}
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


def auto_jobs(rc) -> int:
    """--jobs auto: 1 on the CPU (its cores are what the ranks already use); on CUDA one lane per
    4 CPU cores, at most 8 - the lanes are CPU-bound (the model's Python), the GPU mostly idle -
    and no more than fit beside each other: every TP=1 lane holds the whole model on GPU 0."""
    import os

    if rc.device != "cuda":
        return 1
    n = max(1, min(8, (os.cpu_count() or 4) // 4))
    weights = _weight_bytes(rc.model)
    if weights:
        try:
            import torch

            total = torch.cuda.get_device_properties(0).total_memory
        except Exception:  # noqa: BLE001 - no device to ask: the CPU-count rule alone
            return n
        n = max(1, min(n, int(0.7 * total // (weights + (3 << 30)))))
    return n


def _weight_bytes(model: str) -> int:
    """An hf: checkpoint's weight files' size (0: not known)."""
    import glob
    import os

    if not model.startswith("hf:"):
        return 0
    files = [f for ext in ("*.safetensors", "*.bin", "*.pt") for f in glob.glob(os.path.join(model[3:], ext))]
    return sum(os.path.getsize(f) for f in files)
