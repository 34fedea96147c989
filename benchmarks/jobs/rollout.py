"""`tpdiag rollout` speed (issue 56 item 6): write a checkpoint, run transformers' generate() on it
as the engine (examples/engine_repro.py: Llama-3.2-1B-shaped bf16, batch 4, 64-token prompts, 128
new tokens), then `tpdiag rollout` over a configuration grid once per --jobs value; print the wall
time per configuration and in total, forward MFU beside each (benchmarks/mfu.py's model FLOPs,
forward only: 2 N tokens + the causal attention term), and check that every --jobs value gives
every configuration's logprobs bit for bit as the first one does.

    python -m benchmarks rollout                                  # one GPU: TP=1, jobs 1 vs auto
    python -m benchmarks rollout --fix none,all --jobs 1,auto,4   # one GPU: issue 56's 8 TP=1 configurations
    python -m benchmarks rollout --tp 1,2 --fix none,all --jobs 1,auto,4   # two GPUs: issue 56's 16
    python -m benchmarks rollout --tp 1,2 --fix none,all --jobs auto,auto:4,auto:7,auto:5:1  # auto swept
    python -m benchmarks rollout --small --device cpu --prompt 16 --new 12 --jobs 1,2   # CPU smoke

Each rollout runs in its own process (`python -m benchmarks.jobs.rollout --one ...`: the wall time
a user sees, start-up and model load included), which saves its logprobs for the bit check.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

from benchmarks.proc import run_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine_repro():
    spec = importlib.util.spec_from_file_location("tpdiag_engine_repro", os.path.join(ROOT, "examples",
                                                                                      "engine_repro.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bench-rollout")
    ap.add_argument("--small", action="store_true", help="a tiny llama (CPU smoke)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--tp", default="1")
    ap.add_argument("--micro-batch", default="4,1")
    ap.add_argument("--mode", default="prefill,decode")
    ap.add_argument("--fix", default="none")
    ap.add_argument("--flags", default="default")
    ap.add_argument("--jobs", default="1,auto", help="--jobs values to run, each a whole rollout (the first is "
                                                      "the bit-check's reference); auto:P is auto with P "
                                                      "processes a GPU instead of its CPU-count rule, auto:P:M "
                                                      "also at most M lanes per TP > 1 degree (a sweep)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rollout")
    ap.add_argument("--peak-tflops", type=float, default=None)
    return ap.parse_args(argv)


def forward_flops(model: str, seqs) -> float | None:
    """Model FLOPs of one forward over every sequence (each position once, as both prefill and
    decode compute it): 2 N tokens + 2 layers hidden sum(L^2) (causal half of 4 L^2 hidden)."""
    from benchmarks.mfu import preset_dims

    d = preset_dims(model)
    if d is None:
        return None
    lens = [len(s["input_ids"]) for s in seqs]
    return 2 * d["matmul_params"] * sum(lens) + 2 * d["layers"] * d["hidden"] * sum(n * n for n in lens)


def main(argv: list[str]) -> dict:
    a = parse(argv)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            from benchmarks.errors import NeedsCuda

            raise NeedsCuda("rollout: CUDA (or --small --device cpu)")
    er = _engine_repro()
    os.makedirs(a.work, exist_ok=True)
    model_dir = er.write_checkpoint(os.path.join(a.work, "model"), er.SMALL if a.small else er.LLAMA_1B, a.device)
    path = os.path.join(a.work, "rollout.jsonl")
    t0 = time.perf_counter()
    er.engine(model_dir, path, a.batch, a.prompt, a.new, a.device)
    gen_s = time.perf_counter() - t0  # load + generate(), as engine_repro prints generate() alone
    with open(path) as f:
        seqs = [json.loads(line) for line in f if line.strip()]
    model = f"hf:{model_dir}"
    flops = forward_flops(model, seqs)
    peak, gpu = None, None
    if a.device == "cuda":
        import torch

        from benchmarks.mfu import peak_flops

        gpu = torch.cuda.get_device_name(0)
        peak = peak_flops(gpu, a.peak_tflops)
    from benchmarks.mfu import fmt, mfu

    runs, ref, ok = [], None, True
    for jobs in a.jobs.split(","):
        out = os.path.join(a.work, f"jobs-{jobs}")
        cmd = [sys.executable, "-m", "benchmarks.jobs.rollout", "--one", out, path, "--model", model,
               "--dtype", "bfloat16", "--device", a.device, "--tp", a.tp, "--micro-batch", a.micro_batch,
               "--mode", a.mode, "--fix", a.fix, "--flags", a.flags, "--jobs", jobs]
        t0 = time.perf_counter()
        rc, so, se = run_group(cmd, a.timeout, cwd=ROOT)
        wall = time.perf_counter() - t0
        if rc != 0:
            print(f"jobs {jobs}: rc {rc}\n{se[-3000:]}", flush=True)
            runs.append({"jobs": jobs, "rc": rc, "wall_s": round(wall, 2)})
            ok = False
            continue
        with open(out + ".json") as f:
            s = json.load(f)
        import torch

        lps = torch.load(out + ".pt")
        same = None
        if ref is None:
            ref = lps
        else:
            same = _same_bits(ref, lps)
            ok = ok and same
        print(f"\n--jobs {jobs}: wall {wall:.1f} s (rollout's own {s['seconds']:.1f} s); generate() + load "
              f"{gen_s:.1f} s (stock forward MFU {fmt(mfu(flops, gen_s, 1, peak))}); "
              f"{len(s['configurations'])} configurations"
              + ("" if same is None else f"; every logprob bit for bit as --jobs {a.jobs.split(',')[0]}: {same}"))
        print(f"  {'configuration':40s} {'s':>8s} {'fwd MFU':>8s}  exact")
        rows = {}
        for lab, r in s["configurations"].items():
            sec = r.get("seconds") or 0.0
            m = mfu(flops, sec, r["tp"], peak)
            ex = f"{r['metrics']['exact_tokens']}/{r['metrics']['tokens']}" if "metrics" in r else r["status"]
            print(f"  {lab:40s} {sec:8.2f} {fmt(m):>8s}  {ex}")
            rows[lab] = {"s": sec, "mfu": m, "status": r["status"]}
        print(f"  SDPA backend that ran: {s.get('sdpa_ran')}")
        for note in s.get("notes", []):
            if note.startswith("ran in lanes"):
                print(f"  {note.split(', a configuration')[0]}")
        for lane, v in sorted(s.get("bench_lanes", {}).items(), key=lambda kv: -kv[1]["ended_at"]):
            print(f"  {lane}: {v['seconds']:.1f} s, ended {v['ended_at']:.1f} s into the rollout")
        runs.append({"jobs": jobs, "rc": rc, "wall_s": round(wall, 2), "rollout_s": s["seconds"],
                     "configurations": rows, "lanes": s.get("bench_lanes"), "same_bits_as_first": same,
                     "sdpa_ran": s.get("sdpa_ran")})
    gen_mfu = mfu(flops, gen_s, 1, peak)
    print(f"\ngenerate() (the engine, load included): {gen_s:.1f} s, forward MFU {fmt(gen_mfu)}; gpu {gpu}")
    return {"tp": a.tp, "micro_batch": a.micro_batch, "mode": a.mode, "fix": a.fix, "flags": a.flags,
            "batch": a.batch, "prompt": a.prompt, "new": a.new, "small": a.small, "device": a.device,
            "gpu": gpu, "generate_s": round(gen_s, 2), "generate_mfu": gen_mfu, "runs": runs, "ok": ok}


def _same_bits(a: dict, b: dict) -> bool:
    import torch

    if set(a) != set(b):
        return False
    for lab in a:
        for x, y in zip(a[lab], b[lab]):
            nan = torch.isnan(x)
            if not (torch.equal(nan, torch.isnan(y))
                    and torch.equal(x[~nan].view(torch.int32), y[~nan].view(torch.int32))):
                print(f"  bits differ: {lab}", flush=True)
                return False
    return True


def _one(argv: list[str]) -> int:
    """One rollout in this process: OUT.json (the summary) and OUT.pt (every configuration's logprobs)."""
    out, rest = argv[0], argv[1:]
    import torch

    from tpdiag.rollout.run import run_rollout

    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    for k in ("--model", "--dtype", "--device", "--tp", "--micro-batch", "--mode", "--fix", "--flags", "--jobs"):
        ap.add_argument(k)
    a = ap.parse_args(rest)
    from tpdiag.runner import attention as attn
    from tpdiag.rollout.run import (RolloutConfig, parse_fixes, parse_ints, parse_jobs, parse_modes,
                                    parse_padding)
    from tpdiag.runner import flags as backend_flags

    rc = RolloutConfig(file=a.file, model=a.model, tp=parse_ints("--tp", a.tp),
                       micro_batch=parse_ints("--micro-batch", a.micro_batch), modes=parse_modes(a.mode),
                       fixes=parse_fixes(a.fix), dtype=a.dtype, device=a.device,
                       flags=backend_flags.parse("--flags", a.flags), attention=attn.parse("auto"),
                       padding=parse_padding("auto"), jobs=parse_jobs(a.jobs.split(":")[0]))
    if a.jobs.startswith("auto:"):
        # the sweep's knobs: auto:P - P processes a GPU; auto:P:M - and at most M lanes per TP > 1
        # degree (auto:P:1 is the TP > 1 single world of 1012b3a, the TP=1 lanes spread over the GPUs)
        from tpdiag.rollout import lanes

        knobs = [int(x) for x in a.jobs.split(":")[1:]]
        gpus = lanes._gpu_count(rc)
        lanes.auto_budget = lambda rc: (gpus, knobs[0])
        if len(knobs) > 1:
            share = lanes.share
            lanes.share = lambda work, units, slots: share(
                work, {t: (min(n, knobs[1]) if t > 1 else n) for t, n in units.items()}, slots)
    got, lane_s = {}, {}
    t0 = time.perf_counter()

    def status(what, state):  # each lane's wall time, start-up included: the critical path
        if " lane " in what and state.startswith("done in "):
            lane_s[what] = {"seconds": float(state.split()[2]), "ended_at": round(time.perf_counter() - t0, 2)}

    s = run_rollout(rc, on_status=status, on_logprobs=got.update)
    s["bench_lanes"] = lane_s
    from tpdiag.base import files as io

    with open(out + ".json", "w") as f:
        f.write(io.dumps(s, indent=1))
    torch.save(got, out + ".pt")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        sys.exit(_one(sys.argv[2:]))
    print(json.dumps(main(sys.argv[1:]), indent=1, default=str))
