"""Step time of a ~0.9B Llama (the `llama-1b` preset) with every fix vs stock, TP=2 and TP=4.

One training step = forward, vocab-parallel loss, backward, grad-norm clip, AdamW. No probes:
this measures what a user pays for running with the fixes on. Stock and fixed are timed in
the same world, alternating, medians of CUDA-synchronised steps after warm-up.
Run on a lent multi-GPU machine:  python3 benchmarks/bench_fix_cost.py --tp 2,4
  --each: every fix alone too, in the same rounds; --profile N: the top N ops of one stock and one
  fixed step under torch.profiler (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

FIXES = ("tp-invariant-linear", "invariant-gemm", "invariant-vocab-softmax", "invariant-grad-norm")


def worker(rank, world, port, args, q):
    import torch
    import torch.distributed as dist

    from tpdiag.config import WorldConfig
    from tpdiag.fixes.registry import apply_fixes
    from tpdiag.runner import determinism
    from tpdiag.runner.step import _numerics, build_model, loss_context, make_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    determinism.setup(0, "cuda")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    cfg = WorldConfig(model=args.model, degree=world, label=str(world), out_dir="/tmp/x",
                      dtype=args.dtype, device="cuda", batch_size=args.batch, seq_len=args.seq)
    target, model = build_model(cfg, dev, world)
    batch, labels = make_batch(cfg, target, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    nparams = sum(p.numel() for p in model.parameters()) * (1 if world == 1 else 1)

    def step(fixes):
        with apply_fixes(fixes, model=model, plan=target.plan, world=world):
            loss_fn, _, norm_fn = _numerics(target)
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = model(**batch)
            with loss_context(world):
                loss = loss_fn(logits, labels)
                loss.backward()
            norm_fn(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t

    # --each: every fix alone too (its own share of the cost), in the same rounds
    configs = {"stock": (), "fix-all": FIXES}
    if args.each:
        configs.update({f: (f,) for f in FIXES})
    times = {k: [] for k in configs}
    for _ in range(2):
        for fixes in configs.values():
            step(fixes)
    for _ in range(args.iters):
        for k, fixes in configs.items():
            times[k].append(step(fixes))
    peak = torch.cuda.max_memory_allocated(dev) / 2**30
    if args.profile:
        # where the fix step's extra time goes: device kernels by total time, rank 0
        from torch.profiler import ProfilerActivity, profile

        for name, fixes in (("stock", ()), ("fix-all", FIXES)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(fixes)
            if rank == 0:
                print(f"== profile TP={world} {name} ==")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile))
    if rank == 0:
        q.put({"tp": world, "stock_ms": 1e3 * statistics.median(times["stock"]),
               "fix_ms": 1e3 * statistics.median(times["fix-all"]),
               "stock_spread_ms": 1e3 * (max(times["stock"]) - min(times["stock"])),
               "fix_spread_ms": 1e3 * (max(times["fix-all"]) - min(times["fix-all"])),
               "peak_gib": peak, "params_per_rank": nparams,
               "each_ms": {k: 1e3 * statistics.median(v) for k, v in times.items() if k in FIXES}})
    dist.barrier()
    dist.destroy_process_group()


def main():
    import torch
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--each", action="store_true", help="also time every fix alone")
    ap.add_argument("--profile", type=int, default=0, help="print the top N device ops of one step each")
    args = ap.parse_args()
    rows = []
    for i, tp in enumerate(int(x) for x in args.tp.split(",")):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        mp.start_processes(worker, args=(tp, 29600 + i, args, q), nprocs=tp, start_method="spawn")
        rows.append(q.get())
    gpu = torch.cuda.get_device_name(0)
    lines = [f"machine: {torch.cuda.device_count()}x {gpu}, torch {torch.__version__}, "
             f"model {args.model} {args.dtype}, batch {args.batch} x seq {args.seq}",
             "| TP | stock ms/step | all fixes ms/step | overhead | peak GiB (rank 0) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['stock_ms']:.1f} (spread {r['stock_spread_ms']:.1f}) | "
                     f"{r['fix_ms']:.1f} (spread {r['fix_spread_ms']:.1f}) | "
                     f"{100 * (r['fix_ms'] / r['stock_ms'] - 1):+.0f}% | {r['peak_gib']:.1f} |")
    for r in rows:
        for k, v in r["each_ms"].items():
            lines.append(f"| {r['tp']} | {k} alone | {v:.1f} | {100 * (v / r['stock_ms'] - 1):+.0f}% | |")
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fix_cost.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
