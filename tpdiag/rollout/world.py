"""TP > 1 for `tpdiag rollout`: one world per degree, launched and watched by compare's own
launcher (tpdiag.runner.launch.run_world, with this module's `main` as each rank's entry).

Each rank builds the model sharded as compare's worlds do (tpdiag.runner.build.build_model),
computes every configuration of its degree (micro-batch x mode x fix) with the same code as
TP=1 (tpdiag.rollout.compute), and rank 0 writes the logprobs as JSON (float32 values, exact in
JSON) in the world's directory. The sequences come in as `sequences.json` there.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

from tpdiag.base.configs import folder
from tpdiag.runner.rank_exit import leave

SEQUENCES = "sequences.json"
RESULTS = "logprobs.json"


def write_inputs(out_dir: str, seqs, configs, units=None, threads: int = 1, first_gpu: int = 0,
                 sampling=(), max_cache_len: int = 0, max_new_tokens: int = 0, recipe=None) -> None:
    """units: [(config, lo, hi)] - each configuration over the sequences [lo, hi) (lo a multiple
    of its micro-batch, so its micro-batches are the whole run's); None: every configuration
    over every sequence. threads: torch's CPU threads in each rank (the in-process TP=1's count).
    first_gpu: rank r runs on CUDA device first_gpu + r (tpdiag.rollout.lanes.placement)."""
    from tpdiag.base import files as io

    io.write_json(os.path.join(out_dir, SEQUENCES), {
        "configs": [c.to_dict() for c in configs], "threads": threads, "first_gpu": first_gpu,
        "sampling": [list(kv) for kv in sampling], "max_cache_len": int(max_cache_len),
        "max_new_tokens": int(max_new_tokens), **({"recipe": recipe.to_dict()} if recipe is not None else {}),
        **({} if units is None else {"units": [{"config": c.to_dict(), "lo": lo, "hi": hi} for c, lo, hi in units]}),
        "sequences": [{"input_ids": s.input_ids, "prompt_len": s.prompt_len, "logprobs": s.logprobs,
                       "has_prompt_logprobs": s.prompt_logprobs is not None} for s in seqs]})


def unit_key(label: str, lo: int, hi: int) -> str:
    return f"{label}@{lo}:{hi}"


def run_degree(world: int, rc, seqs, configs, work_dir: str, tree_groups: int, units=None, lane: int | None = None,
               threads: int = 1, flags: str | None = None, first_gpu: int = 0, cancel=None,
               on_launch=None) -> dict:
    """{label: {'status': 'ok', 'logprobs': [[...] per sequence]} | {'status', 'reason'}} - keyed
    by unit_key(label, lo, hi) when `units` are given (one lane of several: tpdiag.rollout.lanes).
    flags: the setting the ranks start under (before their first GEMM); default the first
    configuration's. cancel: an Event that ends the world now; on_launch(): called once the
    launcher has set up this process's side (its environment included) and starts the ranks."""
    from tpdiag.base import files as io
    from tpdiag.config import WorldConfig
    from tpdiag.runner.launch import run_world

    out_dir = os.path.join(work_dir, folder(world) + ("" if lane is None else f"-lane{lane}"))
    os.makedirs(out_dir, exist_ok=True)
    write_inputs(out_dir, seqs, configs, units, threads, first_gpu, rc.sampling, rc.max_cache_len,
                 rc.max_new_tokens, rc.recipe)
    cfg = WorldConfig.of(model=rc.model, degree=world, label=str(world), out_dir=out_dir, dtype=rc.dtype,
                         device=rc.device, backward=False, seed=rc.seed, probes=False, selfcheck=False,
                         tree_groups=tree_groups, flags=flags or configs[0].flags)
    launched = (lambda _label, state: on_launch() if state == "running" else None) if on_launch else None
    res = run_world(cfg, rc.timeout, on_status=launched, entry=main, cancel=cancel)
    if res.status != "ok":
        keys = [c.rollout_name() for c in configs] if units is None else [unit_key(c.rollout_name(), lo, hi) for c, lo, hi in units]
        return {k: {"status": "failed", "reason": f"TP={world} world failed: {res.error}"} for k in keys}
    return io.read_json(os.path.join(out_dir, RESULTS))


def main(rank: int, world: int, host: str, port: int, cfg_dict: dict, timeout_s: float,
         launcher_pid: int | None = None, launched_at: float | None = None) -> None:
    from tpdiag.base import files as io
    from tpdiag.config import WorldConfig
    from tpdiag.runner import worker

    worker._watch_launcher(launcher_pid)
    cfg = WorldConfig.from_dict(cfg_dict)
    try:
        _run(rank, world, host, port, cfg, timeout_s)
        io.write_json(worker.marker(cfg.out_dir, rank, "done"), {"rank": rank, "time": time.time(),
                                                                 "timings": {}})
    except BaseException as e:  # noqa: BLE001 - every failure must leave evidence on disk
        message = str(e).splitlines()[0] if str(e) else ""
        try:
            io.write_json(worker.marker(cfg.out_dir, rank, "error"), {
                "rank": rank, "type": type(e).__name__, "message": message, "where": None,
                "model_where": None, "traceback": traceback.format_exc()})
        except BaseException:  # noqa: BLE001
            sys.stderr.write(f"tpdiag rollout: rank {rank} of TP={world}: {type(e).__name__}: {message}\n")
        leave(1)
    leave(0)  # no interpreter teardown (tpdiag.runner.rank_exit)


def _run(rank: int, world: int, host: str, port: int, cfg, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from tpdiag.base import files as io
    from tpdiag.rollout.compute import Config, Unavailable, logprobs
    from tpdiag.rollout.read import Sequence
    from tpdiag.runner.recipe import Recipe
    from tpdiag.runner import determinism
    from tpdiag.runner.sdpa_ran import SdpaRan
    from tpdiag.runner.build import build_model

    determinism.setup(cfg.seed, cfg.device, cfg.flags)
    inputs = io.read_json(os.path.join(cfg.out_dir, SEQUENCES))
    if cfg.device == "cuda":
        # before anything touches CUDA: the device mesh and NCCL take the device set here
        gpu = int(inputs.get("first_gpu") or 0) + rank
        torch.cuda.set_device(gpu)
        device, backend = torch.device("cuda", gpu), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    store = dist.TCPStore(host, port, world_size=world + 1, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))
    seqs = [Sequence(s["input_ids"], s["prompt_len"], s["logprobs"],
                     [] if s["has_prompt_logprobs"] else None) for s in inputs["sequences"]]
    target, model = build_model(cfg, device, world)
    model.eval()
    torch.set_num_threads(int(inputs.get("threads") or 1))
    out = {}
    flag_values: dict = {}
    units = inputs.get("units") or [{"config": c, "lo": 0, "hi": len(seqs)} for c in inputs["configs"]]
    for u in units:
        c, lo, hi = Config(**u["config"]), u["lo"], u["hi"]
        key = c.rollout_name() if "units" not in inputs else unit_key(c.rollout_name(), lo, hi)
        ran = SdpaRan()
        t0 = time.perf_counter()
        try:
            with ran:
                lps = logprobs(c, target, model, seqs[lo:hi], world=world, tree_groups=cfg.tree_groups,
                               on_flags=lambda k, v: flag_values.setdefault(k, v),
                               sampling=tuple(tuple(kv) for kv in inputs.get("sampling") or ()),
                               max_cache_len=int(inputs.get("max_cache_len") or 0),
                               max_new_tokens=int(inputs.get("max_new_tokens") or 0),
                               recipe=Recipe(**inputs["recipe"]) if inputs.get("recipe") else None)
        except Unavailable as e:
            out[key] = {"status": "unavailable", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - one configuration failing leaves the others
            out[key] = {"status": "failed", "reason": f"{type(e).__name__}: "
                                                      f"{str(e).splitlines()[0] if str(e) else ''}"[:300]}
        else:
            out[key] = {"status": "ok", "logprobs": [t.tolist() for t in lps],
                        "flag_values": {c.flags: flag_values.get(c.flags)}}
        out[key].update(seconds=round(time.perf_counter() - t0, 3), sdpa_ran=ran.counts)
    if rank == 0:
        io.write_json(os.path.join(cfg.out_dir, RESULTS), out)
    dist.barrier()
