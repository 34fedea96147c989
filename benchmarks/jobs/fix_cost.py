"""What the fixes cost: one training step of a ~0.9B Llama (the `llama-1b` preset) with every fix
alone and all together, against stock, at TP=2 and TP=4 and two sizes.

One training step = forward, vocab-parallel loss, backward, grad-norm clip, AdamW (foreach off).
No probes: this is what a user pays for running with the fixes on. Every configuration (stock,
each fix alone, all fixes) runs in the same world, interleaved: each round runs every
configuration once, in an order rotated by one per round, so drift in clocks or host load hits
all of them alike. Per configuration: median ms of the timed rounds (device-synchronised) and
the spread (max - min); "x stock" is the median over rounds of (configuration / stock in the
same round), with its range. Beside every ratio: the stock step's MFU (benchmarks/mfu.py:
model FLOPs = 6 * matmul params * tokens + causal attention 6 * layers * seq^2 * hidden * batch,
over TP x the GPU's dense bf16 peak, 989.4 TFLOP/s on H100 / H200, else --peak-tflops).

Sizes: batch 8 x seq 4096 (GPU-bound: the device, not the host's launches, sets the pace) and
batch 1 x seq 2048 (the earlier sessions' size, host-bound), each in its own worlds.

Tree groups (--groups): every fix that reduces in the tree of G groups runs once per G of the
list, in the same rounds ("all fixes G=8" beside "all fixes G=2"). "tp" is the world's degree:
one group per rank, the group GEMM one invariant GEMM (what a compare whose largest degree this is
runs by default); any other G keeps a rank's groups fused in tree_mm (tpdiag/fixes/groups.py).

    python -m benchmarks fix-cost                          # TP=2,4; 8x4096 and 1x2048; 5 rounds
    python -m benchmarks fix-cost --tp 2 --sizes 1x2048 --iters 7 --profile 30
    python -m benchmarks fix-cost --batch 1 --seq 2048     # one size (--batch / --seq: one size)
    python -m benchmarks fix-cost --groups 8,tp            # G=8 (fused tree_mm) vs G=TP side by side
    python -m benchmarks fix-cost --smoke                  # CPU, gloo, tiny-llama: the code path only
    python -m benchmarks fix-cost --model hf:benchmarks/configs/qwen3-moe-8l --variant sharded-head
    python -m benchmarks fix-cost --loop user --tp 2 --sizes 8x4096   # = python -m benchmarks switch-cost

--loop user: the public switch, `tpdiag.invariant` around a user's own loop, against that loop
without tpdiag at all (benchmarks/jobs/fix_cost_loop.py); --loop internal (the default): the fixes
installed one by one as compare installs them, under tpdiag's determinism setup.

An `hf:` model runs with its config's own TP plan (--variant stock), whose LM head gathers the
whole vocab on every rank (transformers' colwise_gather_output): at 8 x 4096 with a 152k vocab
that alone is 9.3 GiB of bf16 logits per rank, plus the loss's fp32 copy. `--variant
sharded-head` keeps each rank's vocab shard and makes the loss vocab-parallel, as llama-1b's
plan does (tpdiag.models.hf_plan.SHARDED_HEAD): the comparable measurement, and the one that fits.

A world that fails (e.g. out of memory at the larger size) is reported as a row with its error;
the other worlds still run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.mfu import fmt, mfu, peak_flops, step_flops

# every fix the built-in stock plan uses (invariant-norm-grad acts only under sequence
# parallelism, deterministic-collectives is no TP-invariance fix); invariant-attention joined
# after the 2026-11-23 runs, whose "all fixes" rows are these four without it
FIXES = ("tp-invariant-linear", "invariant-gemm", "invariant-vocab-softmax", "invariant-grad-norm",
         "invariant-attention")
SIZES = "8x4096,1x2048"


def configs(each: bool, groups=(None,)) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """{name: (fixes, G)}; G None: the process default (TPDIAG_TREE_GROUPS or 8, fused)."""
    from tpdiag.fixes.groups import uses_groups

    def per_g(name, fixes):
        if not uses_groups(fixes) or groups == (None,):
            return {name: (fixes, None)}
        return {f"{name} G={g}": (fixes, g) for g in groups}

    c = {"stock": ((), None)}
    if each:
        for f in FIXES:
            c.update(per_g(f, (f,)))
    c.update(per_g("all fixes", FIXES))
    return c


def world_groups(spec: str, world: int) -> tuple[int, ...]:
    """--groups '8,tp' at TP=world -> (8, world), repeats dropped."""
    out = []
    for part in spec.split(","):
        g = world if part.strip() == "tp" else int(part)
        if g not in out:
            out.append(g)
    return tuple(out)


def worker(rank, world, port, args, size, q):
    import torch
    import torch.distributed as dist

    from tpdiag.config import WorldConfig
    from tpdiag.fixes.registry import apply_fixes
    from tpdiag.runner import determinism
    from tpdiag.runner.logits import whole_vocab
    from tpdiag.runner.batch import forward_call, make_batch
    from tpdiag.runner.build import build_model
    from tpdiag.runner.logits import logits_of
    from tpdiag.runner.losses import loss_context, step_functions

    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    user = args.loop == "user"
    if user:  # torch's defaults for the stock loop: only the rank's environment and the seed
        for k, v in determinism.RANK_ENV.items():
            os.environ.setdefault(k, v)
        torch.set_num_threads(1)
        torch.manual_seed(0)
    else:
        determinism.setup(0, args.device)
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    batch_size, seq = size
    cfg = WorldConfig.of(model=args.model, degree=world, label=str(world), out_dir="/tmp/x",
                         dtype=args.dtype, device=args.device, batch_size=batch_size, seq_len=seq,
                         variant=args.variant)
    target, model = build_model(cfg, dev, world)
    batch, labels = make_batch(cfg, target, dev)
    fargs, fkwargs = forward_call(model, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from tpdiag.kernels import tree_overlap
    from tpdiag.kernels.tree import install_tree_groups

    overlap_env = tree_overlap.ON[0]  # TPDIAG_TREE_OVERLAP as the process read it

    seen = {}  # the width of a rank's logits: the whole vocab (a gathered head) or its shard

    def step(config):
        fixes, g = config[:2]
        # --overlap: the tree all-reduce in row chunks under the GEMMs (kernels/tree_overlap.py)
        tree_overlap.ON[0] = config[2] if len(config) > 2 else overlap_env
        # G = the world's degree: one group per rank, one invariant GEMM each; a larger G: tree_mm
        with install_tree_groups(g or 0, per_group=g == world), \
                apply_fixes(fixes, model=model, plan=target.plan, world=world):
            loss_fn, _, norm_fn = step_functions(target)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            t = time.perf_counter()
            # an hf: model returns an output object; an unmarked local vocab shard is re-marked
            # whole, as compare's step does (tpdiag.runner.step.run)
            local = logits_of(model(*fargs, **fkwargs))
            # a DTensor's shape is the whole one: its local shard's is what this rank holds
            seen["logits_width"] = int(getattr(local, "_local_tensor", local).shape[-1])
            logits, _ = whole_vocab(local, model, target.plan, target.vocab_size, world)
            with loss_context(world):
                loss = loss_fn(local if target.loss is not None else logits, labels)
                loss.backward()
            norm_fn(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            return time.perf_counter() - t

    cfgs = configs(args.each, world_groups(args.groups, world) if args.groups else (None,))
    if user:
        from benchmarks.jobs.fix_cost_loop import CONFIGS, user_step

        cfgs = dict(CONFIGS)
        step = user_step(model, target, fargs, fkwargs, labels, opt, sync, world, dev, cuda)
    if args.overlap and not user:  # each all-fixes configuration again with the chunked collectives, same rounds
        cfgs.update({f"{k} +overlap": (*v, True) for k, v in list(cfgs.items()) if k.startswith("all fixes")})
    names = list(cfgs)
    times = {k: [] for k in cfgs}
    peak = {k: 0 for k in cfgs}
    for _ in range(args.warmup):
        for config in cfgs.values():
            step(config)
    for r in range(args.iters):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(step(cfgs[k]))
            if cuda:
                peak[k] = max(peak[k], torch.cuda.max_memory_allocated(dev))
    if args.profile:
        # where a step's device time goes, stock vs all fixes (rank 0)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for name in [n for n in names if n == "stock" or n.startswith("all fixes")]:
            with profile(activities=acts, record_shapes=True) as prof:
                step(cfgs[name])
            if rank == 0:
                print(f"== profile TP={world} batch {batch_size} x seq {seq}: {name} ==")
                print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                                row_limit=args.profile))
                print(copies_by_shape(prof, args.profile))
                if args.trace:
                    trace_gaps(prof, args.trace, f"tp{world}-{batch_size}x{seq}-{name}")
    if args.host_profile:
        host_profile(step, {n: cfgs[n] for n in names if n == "stock" or n.startswith("all fixes")},
                     rank, args.host_profile, f"tp{world}-{batch_size}x{seq}")
    if rank == 0:
        q.put({"times_s": times, "peak_bytes": peak, "logits_width": seen.get("logits_width"),
               "vocab": int(target.vocab_size)})
    dist.barrier()
    dist.destroy_process_group()


def host_profile(step, cfgs: dict, rank: int, where: str, tag: str) -> None:
    """Where the host's time goes in one step of each configuration (every rank profiles, rank 0
    keeps it: cProfile, DIR/<tag>-<config>.prof, its top functions printed by own time). A
    function that waits on the GPU (a full launch queue, a sync) shows that wait as its own time."""
    import cProfile
    import pstats

    for name, config in cfgs.items():
        prof = cProfile.Profile()
        prof.runcall(step, config)
        if rank == 0:
            os.makedirs(where, exist_ok=True)
            path = _path(where, f"{tag}-{name}", ".prof")
            prof.dump_stats(path)
            print(f"== host profile {tag}: {name} ({path}) ==")
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def copies_by_shape(prof, top: int) -> str:
    """The step's copies and casts (aten::copy_ under .to / .contiguous / .float) by input
    shapes and dtypes, most device time first: where a fix moves bytes that stock does not."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::copy_":
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            rows.append((dev / 1e3, e.count, str(e.input_shapes)[:110]))
    rows.sort(reverse=True)
    lines = [f"copies by input shape (device ms, calls, shapes), {sum(r[0] for r in rows):.1f} ms in all:"]
    lines += [f"  {ms:8.2f} {n:5d}  {shapes}" for ms, n, shapes in rows[:top]]
    return "\n".join(lines)


def _path(where: str, name: str, ext: str) -> str:
    """A file under `where` named after a configuration (its spaces and '=' made safe)."""
    import re

    return os.path.join(where, re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ext)


def trace_gaps(prof, where: str, name: str) -> None:
    """The profiled step's chrome trace (gzipped, under `where`) and its device idle time."""
    import gzip
    import shutil

    from benchmarks.trace_gaps import analyse, load, render

    os.makedirs(where, exist_ok=True)
    base = _path(where, name, ".json")
    prof.export_chrome_trace(base)
    with open(base, "rb") as f, gzip.open(base + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(base)
    print(render(name, analyse(load(base + ".gz"))))


def run_world(tp: int, port: int, args, size) -> dict:
    """One world of tp ranks; its rank 0's timings, or {"error": one line}."""
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    ctx = mp.start_processes(worker, args=(tp, port, args, size, q), nprocs=tp, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + args.world_timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                return {"error": f"timed out after {args.world_timeout} s"}
    except Exception as e:  # a rank raised (e.g. CUDA OOM) or died: the others were ended
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return {"error": (lines[-1] if lines else type(e).__name__)[:300]}
    return q.get(timeout=30)


def summarize(raw: dict, tp: int, size, flops, peak) -> dict:
    t = raw["times_s"]
    stock = t["stock"]
    stock_med = statistics.median(stock)
    rows = {}
    for k, v in t.items():
        ratios = [a / b for a, b in zip(v, stock)]  # the same round's stock step
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0],) * 3
        rows[k] = {"ms": 1e3 * statistics.median(v), "spread_ms": 1e3 * (max(v) - min(v)),
                   "x_stock": statistics.median(ratios), "x_stock_min": min(ratios), "x_stock_max": max(ratios),
                   "x_stock_q1": q1, "x_stock_q3": q3, "mfu": mfu(flops, statistics.median(v), tp, peak),
                   # every round's step, so that anyone can recompute the figures (round r of
                   # every configuration ran in the same round, in a rotating order)
                   "step_ms": [round(1e3 * x, 2) for x in v],
                   "peak_gib": raw["peak_bytes"][k] / 2**30, "rounds": len(v)}
    return {"tp": tp, "batch": size[0], "seq": size[1], "stock_mfu": mfu(flops, stock_med, tp, peak),
            "logits_width": raw.get("logits_width"), "vocab": raw.get("vocab"), "configs": rows}


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        b, _, s = part.strip().lower().partition("x")
        if not (b.isdigit() and s.isdigit()) or int(b) < 1 or int(s) < 1:
            raise argparse.ArgumentTypeError(f"size {part!r}: expected BATCHxSEQ, e.g. 8x4096")
        out.append((int(b), int(s)))
    return out


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks fix-cost", description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="2,4", help="TP degrees, one world each (default 2,4)")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--loop", choices=("internal", "user"), default="internal",
                   help="internal: each fix as compare installs it (default); user: the public "
                        "tpdiag.invariant around a user's own loop vs that loop without tpdiag")
    p.add_argument("--variant", default="stock",
                   help="the model's plan variant, as compare's --variant (an hf: model: sharded-head "
                        "keeps the LM head's logits as vocab shards with a vocab-parallel loss)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help=f"BATCHxSEQ list, each in its own worlds (default {SIZES})")
    p.add_argument("--batch", type=int, default=None, help="one size only: this batch (default 8)")
    p.add_argument("--seq", type=int, default=None, help="one size only: this sequence length (default 4096)")
    p.add_argument("--iters", type=int, default=5, help="timed rounds (every configuration once per round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--each", action=argparse.BooleanOptionalAction, default=True,
                   help="every fix alone too, in the same rounds (default on; --no-each: stock vs all)")
    p.add_argument("--overlap", action="store_true",
                   help="also each all-fixes configuration with the tree all-reduce in row chunks "
                        "under the GEMMs (TPDIAG_TREE_OVERLAP; _CHUNKS, _SMS set its shape)")
    p.add_argument("--groups", default="tp",
                   help="tree groups G, a comma list of powers of two or 'tp' (the world's degree: one "
                        "group per rank), each a configuration of its own (default tp; e.g. 8,tp; "
                        "'' = the process default, TPDIAG_TREE_GROUPS or 8)")
    p.add_argument("--profile", type=int, default=0, help="print the top N ops of one stock and each all-fixes step")
    p.add_argument("--host-profile", default="", metavar="DIR",
                   help="after the timed rounds, one cProfiled step of stock and of all fixes (rank 0's "
                        "host time by function; DIR/*.prof)")
    p.add_argument("--trace", default="", help="with --profile: write each profiled step's chrome "
                   "trace (gzipped) to this folder and print the device's idle time and its largest gaps")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak TFLOP/s of one GPU for MFU (default: 989.4 on H100/H200, else no MFU)")
    p.add_argument("--world-timeout", type=int, default=400, help="seconds one world may take")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, gloo, fp32, TP=1,2, sizes 1x16 and 2x16, 2 rounds: the code path only "
                        "(tiny-llama unless --model names another, e.g. a tiny hf: directory)")
    args = p.parse_args(argv)
    if args.batch is not None or args.seq is not None:
        if args.sizes is not None:
            p.error("give --sizes or --batch/--seq, not both")
        args.sizes = [(args.batch or 8, args.seq or 4096)]
    if args.smoke:
        args.model = args.model if "--model" in argv else "tiny-llama"
        args.dtype, args.device = "float32", "cpu"
        args.tp = args.tp if "--tp" in argv else "1,2"
        args.sizes = args.sizes or [(1, 16), (2, 16)]
        args.iters = args.iters if "--iters" in argv else 2
        args.warmup = args.warmup if "--warmup" in argv else 1
    else:
        args.device = "cuda"
    args.sizes = args.sizes or parse_sizes("8x4096" if args.loop == "user" else SIZES)
    from tpdiag.models.plans import HF_VARIANTS, VARIANTS

    # a py: target's variants are its own (the world says which); the others are known here
    offered = HF_VARIANTS if args.model.startswith("hf:") else None if args.model.startswith("py:") else VARIANTS
    if offered and args.variant not in offered:
        p.error(f"--variant {args.variant!r}: expected one of {', '.join(offered)} for --model {args.model}")
    try:
        args.tps = [int(x) for x in args.tp.split(",")]
    except ValueError:
        p.error(f"--tp {args.tp!r}: expected a comma list of integers, e.g. 2,4")
    args.groups = args.groups.strip()
    for tp in args.tps if args.groups else ():
        try:
            gs = world_groups(args.groups, tp)
        except ValueError:
            p.error(f"--groups {args.groups!r}: expected a comma list of powers of two or 'tp', e.g. 8,tp")
        bad = next((g for g in gs if g < 1 or g & (g - 1) or g % tp), None)
        if bad is not None:
            p.error(f"--groups {args.groups!r}: G={bad} at TP={tp}: G must be a power of two the degree divides")
    return args


def main(argv: list[str]) -> dict:
    args = parse(argv)
    import torch

    if args.device == "cuda":
        from benchmarks.errors import require_cuda

        require_cuda("fix-cost", "--smoke runs its code path on CPU (gloo)")
        if max(args.tps) > torch.cuda.device_count():
            from benchmarks.errors import JobUnavailable

            raise JobUnavailable(f"fix-cost --tp {args.tp} needs {max(args.tps)} GPUs, "
                                 f"{torch.cuda.device_count()} here")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    peak = peak_flops(gpu, args.peak_tflops)
    if args.loop == "user":
        args.groups = "tp"  # the switch runs with G = the world's degree (fix_cost_loop.py)
    rows, port = [], 29600
    for size in args.sizes:
        flops = step_flops(args.model, *size)
        for tp in args.tps:
            raw = run_world(tp, port, args, size)
            port += 1
            if "error" in raw:
                rows.append({"tp": tp, "batch": size[0], "seq": size[1], "error": raw["error"]})
            else:
                rows.append(summarize(raw, tp, size, flops, peak))
    where = f"{torch.cuda.device_count()}x {gpu}" if gpu else "CPU (gloo; smoke: timings say nothing)"
    plan = "" if args.variant == "stock" else f" (plan {args.variant})"
    lines = [f"fix cost: {where}, torch {torch.__version__}, model {args.model}{plan} {args.dtype}, "
             f"{args.iters} interleaved rounds after {args.warmup} warm-up, peak {fmt_peak(peak)}, "
             f"tree groups {args.groups or 'process default'} (tp: the world's degree)",
             "| TP | batch x seq | configuration | ms/step median (spread) | x stock, median (IQR; range) | "
             "MFU | stock MFU | peak GiB (rank 0) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['tp']} | {r['batch']} x {r['seq']} "
        if "error" in r:
            lines.append(head + f"| - | failed: {r['error']} | | | | |")
            continue
        if r.get("logits_width") not in (None, r.get("vocab")):
            head += f"(logits {r['logits_width']} of {r['vocab']} vocab a rank) "
        for k, c in r["configs"].items():
            ratio = "1 (reference)" if k == "stock" else (
                f"{c['x_stock']:.2f}x ({c.get('x_stock_q1', c['x_stock']):.2f}-{c.get('x_stock_q3', c['x_stock']):.2f}; "
                f"{c['x_stock_min']:.2f}-{c['x_stock_max']:.2f})")
            lines.append(head + f"| {k} | {c['ms']:.1f} ({c['spread_ms']:.1f}) | {ratio} | {fmt(c.get('mfu'))} | "
                         f"{fmt(r['stock_mfu'])} | {c['peak_gib']:.1f} |")
    print("\n".join(lines))
    return {"model": args.model, "variant": args.variant, "dtype": args.dtype, "iters": args.iters,
            "warmup": args.warmup,
            "groups": args.groups or None, "peak_flops": peak, "rows": rows,
            "ok": not any("error" in r for r in rows)}


def fmt_peak(peak) -> str:
    return "unknown (no MFU)" if not peak else f"{peak / 1e12:.1f} TFLOP/s per device"
