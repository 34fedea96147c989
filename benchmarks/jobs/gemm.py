"""invariant-gemm vs cuBLAS: speed, accuracy and invariance, in one run.

    python -m benchmarks gemm            # CUDA: table with shipped configs
    python -m benchmarks gemm --sweep    # also time candidate tile configs
    python -m benchmarks gemm --smoke    # CPU, Triton interpreter, tiny shapes
    python -m benchmarks gemm --smoke --sweep    # + the sweep, as a dry run
    # fp32 only, IEEE FMA vs 3xTF32 candidates (~2.5-4 min on an H200):
    python -m benchmarks gemm --sweep --dtypes fp32 --inv-dtypes fp32

For bf16 and fp32 (TF32 off for cuBLAS, allow_tf32=False; the kernel's fp32 precision is its
config's: IEEE fp32 FMA as shipped, or 3xTF32 "tf32x3" for sweep candidates) it reports the
median time (triton.testing.do_bench, L2 flushed between reps) and TFLOP/s of triton_mm and
torch.matmul at 4096^3 and at Llama-3-8B layer shapes (M=4096 tokens), and checks on the
GPU, bitwise, for both triton_mm and cuBLAS:
  * rows: mm(A[i:j], B) == mm(A, B)[i:j]   (batch invariance)
  * cols: mm(A, B[:, c0:c1]) == mm(A, B)[:, c0:c1] for 2/4/8-way shards (column-parallel),
    with B row-major and with B = W.t() (a linear's weight [N, K], sharded by rows of W).
The sweep prints each candidate's rel. error vs a float64 product next to cuBLAS's, and
runs the full invariance table on the best config of each fp32 precision (ieee, tf32x3).
--b-layout nk times B = W.t() (a linear's weight [N, K]) instead of a row-major B [K, N].
Under --smoke the interpreter ignores input_precision: tf32x3 configs run as IEEE fp32.
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

import torch

from tpdiag.kernels import invariant_gemm as ig
from benchmarks.jobs.gemm_checks import (DT_NAME, bits_equal, invariance, prec_group, rel_err, short,
                                          summarize, timer)
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
# fp32 IEEE (FMA) there: 128x128x32 w8 s3 84%; 128x256x32 / 256x128x32 w8 80%; 128x128x32
# w4 41%; 128x128x64 s2 78% -- so the new IEEE candidates try BLOCK_K 8/16 and 16 warps.
# tf32x3 splits each fp32 operand tile in registers into big + small TF32 parts (three
# tensor-core dots per K step), which costs extra shared memory for the split B operand:
# hence 2-4 stages and the halved TMA epilogue (sub). A config that does not fit is
# reported as failed, not fatal. 14 fp32 candidates: ~4 shapes x 3 rounds x 15 timings of
# ~0.2 s (do_bench) + compiles ~ 1.5-2.5 min on an H200.
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
        # IEEE fp32 on the FMA units (shipped in sessions 1-2) and the best 3xTF32 candidate;
        # the other IEEE / tf32x3 candidates of the earlier sweeps are in docs/benchmarks.md.
        GemmConfig(128, 128, 32, 8, 8, 3, tma=False),
        GemmConfig(128, 128, 64, 8, 8, 2, tma=False, fp32_precision="tf32x3"),
        # operands pre-split into three bf16 pieces, 6 or 9 bf16 tensor-core dots per K step
        # (split_gemm.py): 6 pieces' tiles per stage, so fewer stages fit
        GemmConfig(128, 128, 32, 8, 8, 3, tma=True, epilogue_subtile=True, fp32_precision="bf16x6"),
        GemmConfig(128, 128, 32, 8, 8, 4, tma=True, epilogue_subtile=True, fp32_precision="bf16x6"),
        GemmConfig(128, 128, 64, 8, 8, 2, tma=True, epilogue_subtile=True, fp32_precision="bf16x6"),
        GemmConfig(128, 256, 32, 8, 8, 2, tma=True, epilogue_subtile=True, fp32_precision="bf16x6"),
        GemmConfig(128, 256, 32, 16, 8, 3, tma=True, epilogue_subtile=True, fp32_precision="bf16x6"),
        GemmConfig(128, 128, 32, 8, 8, 3, tma=True, epilogue_subtile=True, fp32_precision="bf16x9"),
        GemmConfig(128, 128, 32, 8, 8, 4, tma=True, epilogue_subtile=True, fp32_precision="bf16x9"),
        GemmConfig(128, 256, 32, 8, 8, 2, tma=True, epilogue_subtile=True, fp32_precision="bf16x9"),
    ],
}
SWEEP_SHAPES = SHAPES
ROUNDS = 3  # timings interleaved over rounds; the median of the rounds is reported

def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="benchmarks gemm", description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also time the candidate configs in SWEEP")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (no timings worth reading)")
    p.add_argument("--dtypes", default="bf16,fp32", help="dtypes timed")
    p.add_argument("--inv-dtypes", default="bf16,fp32,fp16", help="dtypes checked for invariance")
    p.add_argument("--b-layout", choices=("kn", "nk"), default="kn",
                   help="timed B: kn = row-major [K, N]; nk = W.t() with W [N, K] (a linear's weight)")
    args = p.parse_args(argv)

    smoke = args.smoke
    if smoke:  # before triton is imported (python -m benchmarks sets it before this module too)
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        from benchmarks.errors import require_cuda

        require_cuda("gemm", "--smoke runs it on CPU under the Triton interpreter")
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

    def operands(M, K, N, dt):
        a = rand(M, K, dtype=dt)
        b = rand(K, N, dtype=dt) if args.b_layout == "kn" else rand(N, K, dtype=dt).t()
        return a, b

    def cfg_for(dt, cfg=None):
        cfg = cfg or ig.default_config(dt, dev)
        if smoke:  # the interpreter: small tiles, pointer kernel
            cfg = dataclasses.replace(cfg, block_m=32, block_n=32, block_k=32, tma=False, warp_specialize=False,
                                      epilogue_subtile=False)
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
        f"interleaved over {ROUNDS} rounds, median of the rounds; cuBLAS fp32 with TF32 off; triton_mm fp32 "
        "in its config's precision (ieee = FMA; tf32x3 = 3xTF32 on tensor cores; bf16x6/bf16x9 = pre-split bf16 pieces on tensor cores)")
    out(f"- timed B layout: {'row-major [K, N]' if args.b_layout == 'kn' else 'W.t(), W [N, K] row-major (linear weight)'}")
    if smoke:
        out("- smoke: the Triton interpreter ignores input_precision, so tf32x3 configs run as IEEE fp32 here")

    def speed_table(cfgs: dict, title: str, key: str):
        out()
        out(f"### {title}")
        out()
        out("| dtype | shape (M x K x N) | cuBLAS ms | cuBLAS TFLOP/s | triton_mm ms | triton_mm TFLOP/s | triton/cuBLAS | rel. err triton | rel. err cuBLAS |")
        out("|---|---|---|---|---|---|---|---|---|")
        rows = results.setdefault(key, [])
        for dt in [d for d in dtypes if d in cfgs]:
            cfg = cfgs[dt]
            out(f"| {DT_NAME[dt]} | config: {short(cfg)} | | | | | | | |")
            for label, M, K, N in (SMOKE_SHAPES if smoke else SHAPES):
                a, b = operands(M, K, N, dt)
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
            if not smoke and cfg is ig.default_config(dt, a.device):
                # the default call: small problems (the 1- and 7-row slices) take the pointer kernel,
                # the whole product TMA (triton_mm's TMA_MIN_WORK) - invariant only if both agree
                kernels.append(("triton_mm [default dispatch]", lambda x, y: ig.triton_mm(x, y)))
            if with_cublas:
                kernels.append(("cuBLAS (torch.matmul)", torch.matmul))
            for name, mm in kernels:
                inv = invariance(mm, a, b, w)
                inv_res[f"{DT_NAME[dt]} {name}"] = inv
                out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | {name} | {summarize(inv)} |")
            # Same tiles through the pointer and the TMA kernels, and B row-major vs B = W.t():
            # equal bits mean the wrapper's layout/alignment-driven choices cannot break invariance.
            if not smoke:
                try:  # the other kernel with the same tiles may not fit in shared memory
                    c_tma = ig.triton_mm(a, b, config=dataclasses.replace(cfg, tma=True))
                    c_ptr = ig.triton_mm(a, b, config=dataclasses.replace(cfg, tma=False, warp_specialize=False))
                    inv_res[f"{DT_NAME[dt]} tma==pointer"] = bits_equal(c_tma, c_ptr)
                    same_k = "equal bits" if inv_res[f"{DT_NAME[dt]} tma==pointer"] else "DIFFERENT bits"
                    del c_tma, c_ptr
                except Exception as e:
                    inv_res[f"{DT_NAME[dt]} tma==pointer"] = f"{type(e).__name__}: {str(e)[:120]}"
                    same_k = f"not run ({type(e).__name__}: {str(e)[:120]!r})"
                c_w = ig.triton_mm(a, w.t(), config=cfg)
                c_b = ig.triton_mm(a, b, config=cfg)
                inv_res[f"{DT_NAME[dt]} B==W.t()"] = bits_equal(c_w, c_b)
                out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | same tiles: TMA kernel vs pointer kernel | {same_k} |")
                out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | triton_mm: B row-major vs B = W.t() | "
                    f"{'equal bits' if inv_res[f'{DT_NAME[dt]} B==W.t()'] else 'DIFFERENT bits'} |")
            rerun = bits_equal(ig.triton_mm(a, b, config=cfg), ig.triton_mm(a, b, config=cfg))
            inv_res[f"{DT_NAME[dt]} rerun"] = rerun
            out(f"| {DT_NAME[dt]} | {M}x{K}x{N} | triton_mm run twice | {'equal bits' if rerun else 'DIFFERENT bits'} |")

    def sweep() -> dict:
        out()
        out(f"### Config sweep (TFLOP/s, median of {ROUNDS} interleaved rounds; each config is fixed for every shape)")
        out()
        out("rel. err: max over the shapes of ||C - C_ref|| / ||C_ref|| (C_ref: float64 product); x cuBLAS: "
            "max over the shapes of (config's rel. err / cuBLAS's at that shape). Quick invariance per shape: "
            "rows 3:100 and the 2nd of 4 column shards; the best config of each group gets the full table below.")
        out()
        sshapes = SMOKE_SHAPES if smoke else SWEEP_SHAPES
        out("| dtype | config | " + " | ".join(f"{x[0]} {x[1]}x{x[2]}x{x[3]}" for x in sshapes)
            + " | geomean vs cuBLAS | rel. err | x cuBLAS |")
        out("|---|---|" + "---|" * (len(sshapes) + 3))
        chosen, sweep_res = {}, results.setdefault("sweep", [])
        for dt in dtypes:
            cands = [cfg_for(dt, c) for c in SWEEP.get(dt, [])]
            times = {i: {} for i in range(-1, len(cands))}  # -1: cuBLAS
            errs = {i: {} for i in range(-1, len(cands))}
            notes = {i: {} for i in range(len(cands))}
            failed = {}
            for label, M, K, N in sshapes:
                a, b = operands(M, K, N, dt)
                ref = ig.reference_mm(a, b)
                errs[-1][label] = rel_err(torch.matmul(a, b), ref)
                for i, cfg in enumerate(cands):
                    if i in failed:
                        continue
                    try:
                        c = ig.triton_mm(a, b, config=cfg)
                        errs[i][label] = e = rel_err(c, ref)
                        ok = e < (1e-5 if dt == torch.float32 else 1e-2)
                        # quick invariance: a row slice and one shard of a 4-way column split
                        ok_inv = bits_equal(ig.triton_mm(a[3:100], b, config=cfg), c[3:100]) and bits_equal(
                            ig.triton_mm(a, b[:, N // 4:N // 2], config=cfg), c[:, N // 4:N // 2])
                        notes[i][label] = ("" if ok else " (WRONG)") + ("" if ok_inv else " (NOT INVARIANT)")
                        del c
                    except Exception as e:  # a config that does not compile or fit is reported, not fatal
                        failed[i] = f"{type(e).__name__}: {str(e)[:150]!r}"
                del ref
                for _ in range(1 if smoke else ROUNDS):
                    times[-1].setdefault(label, []).append(bench(lambda: torch.matmul(a, b)))
                    for i, cfg in enumerate(cands):
                        if i not in failed:
                            times[i].setdefault(label, []).append(bench(lambda: ig.triton_mm(a, b, config=cfg)))
            tf = lambda i, lab, M, K, N: 2 * M * N * K / statistics.median(times[i][lab]) * 1e-9  # noqa: E731
            out(f"| {DT_NAME[dt]} | cuBLAS | " + " | ".join(f"{tf(-1, *x):.1f}" for x in sshapes)
                + f" | 100% | {max(errs[-1].values()):.2e} | 1.0 |")
            best = {}
            for i, cfg in enumerate(cands):
                if i in failed:
                    out(f"| {DT_NAME[dt]} | {short(cfg)} | failed: {failed[i]} |")
                    sweep_res.append({"dtype": DT_NAME[dt], "config": dataclasses.asdict(cfg), "failed": failed[i]})
                    continue
                ratios = [tf(i, *x) / tf(-1, *x) for x in sshapes]
                gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                err = max(errs[i].values())
                err_x = max(errs[i][x[0]] / max(errs[-1][x[0]], 1e-300) for x in sshapes)
                good = not any(notes[i].values())
                out(f"| {DT_NAME[dt]} | {short(cfg)} | " + " | ".join(f"{tf(i, *x):.1f}{notes[i][x[0]]}" for x in sshapes)
                    + f" | {100 * gm:.1f}% | {err:.2e} | {err_x:.2f} |")
                sweep_res.append({"dtype": DT_NAME[dt], "config": dataclasses.asdict(cfg), "ratios": ratios, "ok": good,
                                  "geomean": gm, "rel_err": errs[i], "rel_err_cublas": errs[-1]})
                g = prec_group(dt, cfg)
                if good and (g not in best or gm > best[g][0]):
                    best[g] = (gm, cfg)
            for g, (gm, cfg) in best.items():
                chosen.setdefault(g, {})[dt] = cfg
                out(f"| {DT_NAME[dt]} | best ({g}): {short(cfg)} | | {100 * gm:.1f}% |")
        results["chosen_configs"] = {g: {DT_NAME[k]: dataclasses.asdict(v) for k, v in d.items()} for g, d in chosen.items()}
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
    best_ok = {}
    if args.sweep:
        # The best config of each group (bf16; fp32 ieee; fp32 tf32x3) that is not the shipped
        # one gets the speed table (rel. err next to cuBLAS's) and the full invariance table.
        for g, per_dt in sweep().items():
            cfgs = {dt: c for dt, c in per_dt.items() if c != defaults[dt]}
            if not cfgs:
                continue
            key = g.replace(" ", "_")
            speed_table(cfgs, f"Speed with the sweep's best config ({g})", f"speed_best_{key}")
            invariance_table(cfgs, f"Bitwise invariance (sweep's best config, {g})", f"invariance_best_{key}",
                             with_cublas=False)
            inv = results[f"invariance_best_{key}"]
            best_ok[g] = all(v["all"] for v in inv.values() if isinstance(v, dict)) and all(
                v for k, v in inv.items() if k.endswith(" rerun"))
    out()
    out(f"triton_mm (shipped configs) invariant on every check: {ok}")
    for g, v in best_ok.items():
        out(f"triton_mm (sweep's best {g} config) invariant on every check: {v}")
    return {"ok": ok, "device": gpu, "configs": results["configs"],
            "speed": results["speed"],
            "invariant": {k: v["all"] if isinstance(v, dict) else v for k, v in results["invariance"].items()},
            "linear": results.get("linear"), "best_invariant": best_ok,
            "sweep": [{"dtype": r["dtype"], "config": r["config"], "geomean": r.get("geomean"),
                       "ok": r.get("ok"), "failed": r.get("failed")} for r in results.get("sweep", [])],
            "chosen_configs": results.get("chosen_configs")}
