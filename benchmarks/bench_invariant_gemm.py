"""invariant-gemm vs cuBLAS: speed, accuracy and invariance, in one run.

    PYTHONPATH=. python benchmarks/bench_invariant_gemm.py            # CUDA: table with shipped configs
    PYTHONPATH=. python benchmarks/bench_invariant_gemm.py --sweep    # also time candidate tile configs
    PYTHONPATH=. python benchmarks/bench_invariant_gemm.py --smoke    # CPU, Triton interpreter, tiny shapes

For bf16 and fp32 (TF32 off for both sides: IEEE fp32 in the kernel, allow_tf32=False for
cuBLAS) it reports the median time (triton.testing.do_bench, L2 flushed between reps) and
TFLOP/s of triton_mm and torch.matmul at 4096^3 and at Llama-3-8B layer shapes (M=4096
tokens), and checks on the GPU, bitwise, for both triton_mm and cuBLAS:
  * rows: mm(A[i:j], B) == mm(A, B)[i:j]   (batch invariance)
  * cols: mm(A, B[:, c0:c1]) == mm(A, B)[:, c0:c1] for 2/4/8-way shards (column-parallel),
    with B row-major and with B = W.t() (a linear's weight [N, K], sharded by rows of W).
A markdown report is printed and written to $OUT/bench_invariant_gemm.md (and .json).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the triton import

import torch

from tpdiag.kernels import invariant_gemm as ig
from tpdiag.kernels.invariant_gemm import GemmConfig

# (label, M, K, N)
SHAPES = [
    ("4096^3 (= q/o proj)", 4096, 4096, 4096),
    ("fused qkv", 4096, 4096, 6144),
    ("gate/up", 4096, 4096, 14336),
    ("down", 4096, 14336, 4096),
]
SMOKE_SHAPES = [("smoke", 96, 64, 128)]

# Candidate fixed configs for --sweep (all shape-independent). A first sweep on an H200
# (docs/benchmarks.md) ruled out pointer loads for bf16 (77% of cuBLAS), 256x128 / 128x128
# tiles (92%), 4 stages at 128x256x64 (shared memory) and gave warp specialisation no gain.
SWEEP = {
    torch.bfloat16: [
        GemmConfig(128, 256, 64, 8, 8, 3, tma=True),
        GemmConfig(128, 256, 64, 16, 8, 3, tma=True),
        GemmConfig(128, 256, 64, 32, 8, 3, tma=True),
        GemmConfig(128, 256, 64, 8, 8, 3, tma=True, flatten=True),
        GemmConfig(128, 256, 64, 16, 8, 3, tma=True, flatten=True),
        GemmConfig(128, 256, 64, 16, 8, 3, tma=True, warp_specialize=True),
    ],
    torch.float32: [
        GemmConfig(128, 128, 32, 8, 8, 3, tma=False),
        GemmConfig(128, 128, 32, 8, 8, 3, tma=True),
        GemmConfig(128, 256, 32, 8, 8, 3, tma=False),
        GemmConfig(256, 128, 32, 8, 8, 3, tma=False),
        GemmConfig(128, 128, 32, 8, 4, 3, tma=False),
        GemmConfig(128, 128, 64, 8, 8, 2, tma=False),
    ],
}
SWEEP_SHAPES = SHAPES
ROUNDS = 3  # timings interleaved over rounds; the median of the rounds is reported

IV = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
DT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def short(cfg: GemmConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
            + (" tma" if cfg.tma else " ptr") + (" flat" if cfg.flatten else "")
            + (" ws" if cfg.warp_specialize else ""))


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.contiguous().view(IV[x.dtype]), y.contiguous().view(IV[y.dtype]))


def timer(smoke: bool):
    if smoke:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return bench
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def invariance(mm, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> dict:
    """Bitwise row and column-shard invariance of ``mm``; b is [K, N], w is [N, K]."""
    M, N = a.shape[0], b.shape[1]
    full = mm(a, b)
    row_slices = sorted({(0, 1), (0, 7), (3, 100), (M // 4, M // 4 + 517), (0, M // 2), (M - 1, M), (1, M)})
    row_slices = [(i, min(j, M)) for i, j in row_slices if i < min(j, M)]
    rows = {f"{i}:{j}": bits_equal(mm(a[i:j], b), full[i:j]) for i, j in row_slices}
    cols = {}
    for tp in (2, 4, 8):
        s = N // tp
        cols[f"{tp}-way"] = all(bits_equal(mm(a, b[:, r * s:(r + 1) * s]), full[:, r * s:(r + 1) * s]) for r in range(tp))
    odd = (3, min(N, 3 + N // 3))  # unaligned column range
    cols["odd"] = bits_equal(mm(a, b[:, odd[0]:odd[1]]), full[:, odd[0]:odd[1]])
    # Linear layout: B = W.t(), column-parallel shards are row blocks of W.
    full_w = mm(a, w.t())
    wcols = {}
    for tp in (2, 4, 8):
        s = N // tp
        wcols[f"{tp}-way"] = all(bits_equal(mm(a, w[r * s:(r + 1) * s].t()), full_w[:, r * s:(r + 1) * s]) for r in range(tp))
    return {"rows": rows, "cols": cols, "weight_cols": wcols,
            "all": all(rows.values()) and all(cols.values()) and all(wcols.values()),
            "layout_equal": bits_equal(full, full_w) if torch.equal(w.t(), b) else None}


def summarize(inv: dict) -> str:
    bad = [f"rows {k}" for k, v in inv["rows"].items() if not v]
    bad += [f"cols {k}" for k, v in inv["cols"].items() if not v]
    bad += [f"W-rows {k}" for k, v in inv["weight_cols"].items() if not v]
    n = len(inv["rows"]) + len(inv["cols"]) + len(inv["weight_cols"])
    return "yes (all %d checks)" % n if not bad else "NO: %d/%d differ (%s)" % (len(bad), n, ", ".join(bad))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="also time the candidate configs in SWEEP")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (no timings worth reading)")
    p.add_argument("--dtypes", default="bf16,fp32", help="dtypes timed")
    p.add_argument("--inv-dtypes", default="bf16,fp32,fp16", help="dtypes checked for invariance")
    args = p.parse_args()

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("bench_invariant_gemm: CUDA is not available (use --smoke for a CPU interpreter dry run)")
        return 3
    dev = torch.device("cpu" if smoke else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import triton

    bench = timer(smoke)
    dtypes = [{"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[d] for d in args.dtypes.split(",")]
    inv_dtypes = [{"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[d] for d in args.inv_dtypes.split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    def cfg_for(dt, cfg=None):
        cfg = cfg or ig.default_config(dt, dev)
        if smoke:  # the interpreter: small tiles, pointer kernel
            cfg = dataclasses.replace(cfg, block_m=32, block_n=32, block_k=32, tma=False, warp_specialize=False)
        return cfg

    lines = []
    results = {}
    od = os.environ.get("OUT")

    def out(s=""):
        print(s, flush=True)
        lines.append(s)
        if od:  # rewritten after every line: a crash or timeout later keeps what was measured
            os.makedirs(od, exist_ok=True)
            with open(os.path.join(od, "bench_invariant_gemm.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(od, "bench_invariant_gemm.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)

    gpu = torch.cuda.get_device_name() if not smoke else "CPU (Triton interpreter, smoke run)"
    results.update(device=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    out("## invariant-gemm vs cuBLAS")
    out()
    out(f"- date: {datetime.date.today().isoformat()}")
    out(f"- device: {gpu}")
    out(f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}")
    out("- timing: triton.testing.do_bench median (warmup 25 ms, rep 100 ms, L2 flushed per rep), cuBLAS and triton_mm "
        f"interleaved over {ROUNDS} rounds, median of the rounds; fp32 with TF32 off on both sides")

    def speed_table(cfgs: dict, title: str, key: str):
        out()
        out(f"### {title}")
        out()
        out("| dtype | shape (M x K x N) | cuBLAS ms | cuBLAS TFLOP/s | triton_mm ms | triton_mm TFLOP/s | triton/cuBLAS | rel. err triton | rel. err cuBLAS |")
        out("|---|---|---|---|---|---|---|---|---|")
        rows = results.setdefault(key, [])
        for dt in dtypes:
            cfg = cfgs[dt]
            out(f"| {DT_NAME[dt]} | config: {short(cfg)} | | | | | | | |")
            for label, M, K, N in (SMOKE_SHAPES if smoke else SHAPES):
                a, b = rand(M, K, dtype=dt), rand(K, N, dtype=dt)
                ref = ig.reference_mm(a, b)
                e_t = rel_err(ig.triton_mm(a, b, config=cfg), ref)
                e_c = rel_err(torch.matmul(a, b), ref)
                del ref
                tcs, tts = [], []
                for _ in range(1 if smoke else ROUNDS):  # interleaved: clock/thermal drift hits both
                    tcs.append(bench(lambda: torch.matmul(a, b)))
                    tts.append(bench(lambda: ig.triton_mm(a, b, config=cfg)))
                t_c, t_t = statistics.median(tcs), statistics.median(tts)
                fl = 2 * M * N * K
                row = dict(dtype=DT_NAME[dt], config=short(cfg), shape=f"{M}x{K}x{N}", label=label, cublas_ms=t_c,
                           triton_ms=t_t, cublas_tflops=fl / t_c * 1e-9, triton_tflops=fl / t_t * 1e-9,
                           ratio=t_c / t_t, err_triton=e_t, err_cublas=e_c)
                rows.append(row)
                out(f"| {row['dtype']} | {label}: {row['shape']} | {t_c:.3f} | {row['cublas_tflops']:.1f} | {t_t:.3f} | "
                    f"{row['triton_tflops']:.1f} | {100 * row['ratio']:.1f}% | {e_t:.2e} | {e_c:.2e} |")

    def invariance_table(cfgs: dict, title: str, key: str, with_cublas: bool = True):
        out()
        out(f"### {title}")
        out()
        out("rows: mm(A[i:j], B) == mm(A, B)[i:j] for 7 slices; cols: B[:, shard] for 2/4/8-way shards "
            "and an unaligned range; W-rows: B = W.t() with W sharded by rows (column-parallel linear).")
        out()
        out("| dtype | shape | kernel | invariant? |")
        out("|---|---|---|---|")
        inv_res = results.setdefault(key, {})
        M, K, N = (96, 64, 128) if smoke else (2048, 4096, 6144)
        for dt in inv_dtypes:
            if dt not in cfgs:
                continue
            cfg = cfgs[dt]
            a = rand(M, K, dtype=dt)
            w = rand(N, K, dtype=dt)
            b = w.t().contiguous()
            kernels = [(f"triton_mm [{short(cfg)}]", lambda x, y: ig.triton_mm(x, y, config=cfg))]
            if with_cublas:
                kernels.append(("cuBLAS (torch.matmul)", torch.matmul))
            for name, mm in kernels:
                inv = invariance(mm, a, b, w)
                inv_res[f"{DT_NAME[dt]} {name}"] = inv
                out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | {name} | {summarize(inv)} |")
            # Same tiles through the pointer and the TMA kernels, and B row-major vs B = W.t():
            # equal bits mean the wrapper's layout/alignment-driven choices cannot break invariance.
            if not smoke:
                c_tma = ig.triton_mm(a, b, config=dataclasses.replace(cfg, tma=True))
                c_ptr = ig.triton_mm(a, b, config=dataclasses.replace(cfg, tma=False, warp_specialize=False))
                c_w = ig.triton_mm(a, w.t(), config=cfg)
                c_b = ig.triton_mm(a, b, config=cfg)
                inv_res[f"{DT_NAME[dt]} tma==pointer"] = bits_equal(c_tma, c_ptr)
                inv_res[f"{DT_NAME[dt]} B==W.t()"] = bits_equal(c_w, c_b)
                out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | same tiles: TMA kernel vs pointer kernel | "
                    f"{'equal bits' if inv_res[f'{DT_NAME[dt]} tma==pointer'] else 'DIFFERENT bits'} |")
                out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | triton_mm: B row-major vs B = W.t() | "
                    f"{'equal bits' if inv_res[f'{DT_NAME[dt]} B==W.t()'] else 'DIFFERENT bits'} |")
            rerun = bits_equal(ig.triton_mm(a, b, config=cfg), ig.triton_mm(a, b, config=cfg))
            inv_res[f"{DT_NAME[dt]} rerun"] = rerun
            out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | triton_mm run twice | {'equal bits' if rerun else 'DIFFERENT bits'} |")

    def sweep() -> dict:
        out()
        out(f"### Config sweep (TFLOP/s, median of {ROUNDS} interleaved rounds; each config is fixed for every shape)")
        out()
        sshapes = SMOKE_SHAPES if smoke else SWEEP_SHAPES
        out("| dtype | config | " + " | ".join(f"{x[0]} {x[1]}x{x[2]}x{x[3]}" for x in sshapes) + " | geomean vs cuBLAS |")
        out("|---|---|" + "---|" * (len(sshapes) + 1))
        chosen, sweep_res = {}, results.setdefault("sweep", [])
        for dt in dtypes:
            cands = [cfg_for(dt, c) for c in SWEEP.get(dt, [])]
            times = {i: {} for i in range(-1, len(cands))}  # -1: cuBLAS
            notes = {i: {} for i in range(len(cands))}
            failed = {}
            for label, M, K, N in sshapes:
                a, b = rand(M, K, dtype=dt), rand(K, N, dtype=dt)
                ref = ig.reference_mm(a, b)
                for i, cfg in enumerate(cands):
                    if i in failed:
                        continue
                    try:
                        c = ig.triton_mm(a, b, config=cfg)
                        ok = rel_err(c, ref) < (1e-5 if dt == torch.float32 else 1e-2)
                        # quick invariance: a row slice and one shard of a 4-way column split
                        ok_inv = bits_equal(ig.triton_mm(a[3:100], b, config=cfg), c[3:100]) and bits_equal(
                            ig.triton_mm(a, b[:, N // 4:N // 2], config=cfg), c[:, N // 4:N // 2])
                        notes[i][label] = ("" if ok else " (WRONG)") + ("" if ok_inv else " (NOT INVARIANT)")
                    except Exception as e:  # a config that does not compile or fit is reported, not fatal
                        failed[i] = f"{type(e).__name__}: {str(e)[:150]!r}"
                del ref
                for _ in range(1 if smoke else ROUNDS):
                    times[-1].setdefault(label, []).append(bench(lambda: torch.matmul(a, b)))
                    for i, cfg in enumerate(cands):
                        if i not in failed:
                            times[i].setdefault(label, []).append(bench(lambda: ig.triton_mm(a, b, config=cfg)))
            tf = lambda i, lab, M, K, N: 2 * M * N * K / statistics.median(times[i][lab]) * 1e-9  # noqa: E731
            out(f"| {DT_NAME[dt]} | cuBLAS | " + " | ".join(f"{tf(-1, *x):.1f}" for x in sshapes) + " | 100% |")
            best = None
            for i, cfg in enumerate(cands):
                if i in failed:
                    out(f"| {DT_NAME[dt]} | {short(cfg)} | failed: {failed[i]} |")
                    continue
                ratios = [tf(i, *x) / tf(-1, *x) for x in sshapes]
                gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                good = not any(notes[i].values())
                out(f"| {DT_NAME[dt]} | {short(cfg)} | " + " | ".join(f"{tf(i, *x):.1f}{notes[i][x[0]]}" for x in sshapes)
                    + f" | {100 * gm:.1f}% |")
                sweep_res.append({"dtype": DT_NAME[dt], "config": dataclasses.asdict(cfg), "ratios": ratios, "ok": good})
                if good and (best is None or gm > best[0]):
                    best = (gm, cfg)
            if best is not None:
                chosen[dt] = best[1]
                out(f"| {DT_NAME[dt]} | best: {short(best[1])} | | {100 * best[0]:.1f}% |")
        results["chosen_configs"] = {DT_NAME[k]: dataclasses.asdict(v) for k, v in chosen.items()}
        return chosen

    def linear_checks():
        """invariant_linear / invariant_addmm on this device: accuracy and invariance."""
        out()
        T, D, F = (20, 64, 96) if smoke else (100, 1024, 3072)
        out(f"### invariant_linear / invariant_addmm (x [3, {T}, {D}], weight [{F}, {D}], bias [{F}])")
        out()
        out(f"| dtype | fn | rel. err vs float64 | rows (x[1, 7:{T // 2}]) | column shards (2/4/8-way W rows) |")
        out("|---|---|---|---|---|")
        res = results.setdefault("linear", {})
        for dt in inv_dtypes:
            x = rand(3, T, D, dtype=dt)
            w = (rand(F, D, dtype=dt).float() / 32).to(dt)
            bias = rand(F, dtype=dt)
            for name, fn in (("invariant_linear", lambda x_, w_, b_: ig.invariant_linear(x_, w_, b_)),
                             ("invariant_linear (no bias)", lambda x_, w_, b_: ig.invariant_linear(x_, w_)),
                             ("invariant_addmm a=0.5 b=2", lambda x_, w_, b_: ig.invariant_addmm(
                                 b_, x_.reshape(-1, x_.shape[-1]), w_.t(), beta=2, alpha=0.5).reshape(*x_.shape[:-1], -1))):
                y = fn(x, w, bias)
                if "addmm" in name:
                    r = 2 * bias.double() + 0.5 * (x.double() @ w.double().t())
                else:
                    r = torch.nn.functional.linear(x.double(), w.double(), None if "no bias" in name else bias.double())
                err = ((y.double() - r).norm() / r.norm()).item()
                rows = bits_equal(fn(x[1:2, 7:T // 2], w, bias), y[1:2, 7:T // 2])
                cols = all(bits_equal(fn(x, w[k * (F // tp):(k + 1) * (F // tp)], bias[k * (F // tp):(k + 1) * (F // tp)]),
                                      y[..., k * (F // tp):(k + 1) * (F // tp)]) for tp in (2, 4, 8) for k in range(tp))
                res[f"{DT_NAME[dt]} {name}"] = dict(err=err, rows=rows, cols=cols)
                out(f"| {DT_NAME[dt]} | {name} | {err:.2e} | {'bitwise' if rows else 'DIFFER'} | {'bitwise' if cols else 'DIFFER'} |")

    defaults = {dt: cfg_for(dt) for dt in dict.fromkeys(dtypes + inv_dtypes)}
    results["configs"] = {DT_NAME[k]: dataclasses.asdict(v) for k, v in defaults.items()}
    speed_table(defaults, "Speed with the shipped configs (median ms, TFLOP/s)", "speed")
    invariance_table(defaults, "Bitwise invariance on this device (shipped configs)", "invariance")
    linear_checks()
    ok = all(v["all"] for k, v in results["invariance"].items() if k.split(" ", 1)[1].startswith("triton_mm [")
             and isinstance(v, dict))
    if args.sweep:
        chosen = sweep()
        better = {dt: c for dt, c in chosen.items() if c != defaults[dt]}
        if better:
            cfgs = {dt: better.get(dt, defaults[dt]) for dt in defaults}
            speed_table(cfgs, "Speed with the sweep's best configs", "speed_best")
            invariance_table(cfgs, "Bitwise invariance (sweep's best configs)", "invariance_best", with_cublas=False)
    out()
    out(f"triton_mm (shipped configs) invariant on every check: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
