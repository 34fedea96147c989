"""Invariant attention vs the stock SDPA backends on one GPU, side by side.

For each backend: fwd ms, fwd+bwd ms (median of triton.testing.do_bench), the ratio of fwd+bwd
to the fastest stock backend, bitwise head-slice invariance (the heads of rank r at TP=2,4,8
called alone vs the same heads of the full call: output and dq/dk/dv), batch-slice invariance,
run-to-run reproducibility of dq/dk/dv (checks under torch.use_deterministic_algorithms(True,
warn_only=True)), and the error against a float64 reference at a smaller shape.

    python -m benchmarks.attention [--batch 8 --seq 4096 --heads 32 --dim 64 --dtype bfloat16]
                                   [--sweep] [--no-flex] [--json PATH]
    python -m benchmarks attention --configs d64 [--budget-s 420] [--only NAME,...] [--smoke]

--configs: candidate AttnConfigs at head_dim 64 and 128 against the stock backends, bitwise
checked, in one process (benchmarks/attention_configs.py).

`main(argv) -> dict` is the entry point for `python -m benchmarks attention`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from benchmarks.emit import emit

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "float32": "float32"}


def _variant(spec: str) -> str:
    """FIELD=INT[,FIELD=INT...] naming AttnConfig fields (checked here: a typo is a usage error)."""
    import dataclasses as dc

    from tpdiag.kernels.attention_triton import AttnConfig

    names = {f.name for f in dc.fields(AttnConfig)}
    for kv in spec.split(","):
        name, _, val = kv.partition("=")
        if name not in names or not val.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{kv!r}: expected FIELD=INT with FIELD one of {', '.join(sorted(names))}")
    return spec


def _parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks.attention")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--sweep", nargs="?", const="all", default=None, choices=["all", "fwd"],
                   help="time candidate tile configs of the Triton kernels (fwd: the forward's only)")
    p.add_argument("--keep-config", action="store_true", help="after --sweep, time the shipped tiles anyway")
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    p.add_argument("--no-checks", action="store_true", help="timings only")
    p.add_argument("--variant", action="append", default=[], type=_variant,
                   help="also time the invariant kernels with these AttnConfig fields changed, e.g. "
                        "fwd_warps=4,fwd_stages=4 (repeatable)")
    p.add_argument("--reruns", type=int, default=20,
                   help="invariant backends: dq/dk/dv of this many reruns, each bitwise equal to the first")
    p.add_argument("--json", default=None)
    p.add_argument("--configs", choices=["d64", "d64-only", "d128"], default=None,
                   help="time attention_configs.CANDIDATES side by side with the stock backends (d64: "
                        "D=64 at --batch/--heads and D=128 at half of each; d64-only, d128: one head dim)")
    p.add_argument("--only", default="", help="--configs: these candidates only (comma-separated names)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="--configs: start no further candidate after this many seconds (compiles dominate; "
                        "the shipped configs and the D=128 stock backends still run)")
    p.add_argument("--rounds", type=int, default=3,
                   help="--configs: interleaved re-timings of the fastest candidates, shipped and stock")
    p.add_argument("--smoke", action="store_true",
                   help="--configs on the CPU under the Triton interpreter, tiny shapes (timings mean nothing)")
    p.add_argument("--sass", action="store_true",
                   help="no GPU: the kernels compiled for sm_90 - registers, spills, each inner loop's instruction "
                        "mix at the shipped D=64/D=128 tiles and the --only candidates (benchmarks/attention_sass.py)")
    args = p.parse_args(argv)
    if args.smoke and not args.configs:
        p.error("--smoke goes with --configs")
    return args


def _backends(args, torch, F):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tpdiag.kernels.attention import invariant_sdpa

    causal = not args.no_causal

    def stock(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=q.shape[1] != k.shape[1])
        return f

    out = {"sdpa-flash": stock(SDPBackend.FLASH_ATTENTION),
           "sdpa-efficient": stock(SDPBackend.EFFICIENT_ATTENTION),
           "sdpa-cudnn": stock(SDPBackend.CUDNN_ATTENTION)}
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.cache_size_limit = 64
        flex = torch.compile(flex_attention, dynamic=False)
        masks = {}

        def causal_mod(b, h, qi, ki):
            return qi >= ki

        def fx(q, k, v):
            key = (q.shape[2], k.shape[2])
            if causal and key not in masks:
                masks[key] = create_block_mask(causal_mod, None, None, key[0], key[1], device=q.device)
            return flex(q, k, v, block_mask=masks.get(key) if causal else None,
                        enable_gqa=q.shape[1] != k.shape[1])
        out["flex-compiled"] = fx
    out["invariant-triton"] = lambda q, k, v: invariant_sdpa(q, k, v, is_causal=causal,
                                                             enable_gqa=q.shape[1] != k.shape[1])
    for spec in args.variant:
        # the invariant kernels with some config fields changed (--variant fwd_warps=4,fwd_stages=4):
        # side by side with the shipped config in the same process
        from tpdiag.kernels import attention_triton as at

        changes = {kv.partition("=")[0]: int(kv.partition("=")[2]) for kv in spec.split(",")}

        def variant(q, k, v, changes=changes):
            cfg = dataclasses.replace(at.config_for(q.dtype, q.shape[-1]), **changes)
            return invariant_sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], triton_cfg=cfg)
        out[f"invariant[{spec}]"] = variant
    return out


def _inputs(torch, B, H, Hk, S, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(H), mk(Hk), mk(Hk), mk(H)


def _run(torch, f, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = f(q, k, v)
    o.backward(do)
    torch.cuda.synchronize()
    return o.detach(), q.grad, k.grad, v.grad


def _eq(torch, a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32))


def _checks(torch, f, q, k, v, do) -> dict:
    """Head slices (TP=2,4,8), batch halves and a rerun, all bitwise, fwd + dq/dk/dv."""
    full = _run(torch, f, q, k, v, do)
    again = _run(torch, f, q, k, v, do)
    res = {"repro": {n: _eq(torch, a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), full, again)}}
    H, Hk = q.shape[1], k.shape[1]
    heads = {}
    for tp in (2, 4, 8):
        ok = {"o": True, "dq": True, "dk": True, "dv": True}
        for r in range(tp):
            hs, ks = slice(r * H // tp, (r + 1) * H // tp), slice(r * Hk // tp, (r + 1) * Hk // tp)
            part = _run(torch, f, q[:, hs], k[:, ks], v[:, ks], do[:, hs])
            for n, a, b, s in zip(("o", "dq", "dk", "dv"), part, full, (hs, hs, ks, ks)):
                ok[n] = ok[n] and _eq(torch, a, b[:, s])
        heads[tp] = ok
    res["heads"] = heads
    B = q.shape[0]
    if B > 1:
        ok = {"o": True, "dq": True, "dk": True, "dv": True}
        for bs in (slice(0, B // 2), slice(B // 2, B)):
            part = _run(torch, f, q[bs], k[bs], v[bs], do[bs])
            for n, a, b in zip(("o", "dq", "dk", "dv"), part, full):
                ok[n] = ok[n] and _eq(torch, a, b[bs])
        res["batch"] = ok
    return res


def _reruns(torch, f, q, k, v, do, n: int) -> dict:
    """n reruns, each bitwise equal to the first: an ordering race in a backward shows here."""
    first = _run(torch, f, q, k, v, do)
    ok = {"o": True, "dq": True, "dk": True, "dv": True}
    for _ in range(n - 1):
        for name, a, b in zip(("o", "dq", "dk", "dv"), _run(torch, f, q, k, v, do), first):
            ok[name] = ok[name] and _eq(torch, a, b)
    return ok


def _rel_err(torch, f, args, dtype) -> dict:
    """Max abs error over max |ref| against a float64 reference, at a small shape."""
    from tpdiag.kernels.attention import reference_sdpa

    q, k, v, do = _inputs(torch, 1, 4, 4 if args.kv_heads is None else max(1, 4 * args.kv_heads // args.heads),
                          1024, args.dim, dtype, seed=7)
    o, dq, dk, dv = _run(torch, f, q, k, v, do)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    r = reference_sdpa(q64, k64, v64, is_causal=not args.no_causal)
    r.backward(do.double())
    out = {}
    for n, a, b in (("o", o, r), ("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        out[n] = float((a.double() - b).abs().max() / b.abs().max())
    return out


def _time(torch, f, q, k, v, do) -> tuple[float, float]:
    from triton.testing import do_bench

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    fwd = do_bench(lambda: f(q, k, v), warmup=50, rep=300, return_mode="median")

    def fb():
        f(qg, kg, vg).backward(do)
    both = do_bench(fb, warmup=50, rep=300, grad_to_none=[qg, kg, vg], return_mode="median")
    return fwd, both


def _sweep(torch, q, k, v, do, causal, only_fwd: bool = False) -> dict:
    """Time candidate tiles: forward; then the dk/dv pass (dq tiles fixed), then the dq pass
    (best dk/dv tiles). Returns the timings and the best AttnConfig's fields."""
    from triton.testing import do_bench

    from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb

    base = at.config_for(q.dtype, q.shape[-1])
    sc = 1.0 / math.sqrt(q.shape[-1])
    fwd_c = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 5), (128, 128, 8, 3),
             (128, 128, 8, 4), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 4, 4),
             (128, 64, 8, 2), (128, 64, 4, 2), (256, 64, 8, 3), (256, 64, 8, 2), (256, 64, 16, 3)]
    kv_c = [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3),
            (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 4, 2), (64, 64, 8, 2)]
    q_c = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3),
           (128, 64, 4, 3), (64, 16, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2)]
    res = {"fwd": [], "kv": [], "q": []}

    def bench(fn):
        try:
            return do_bench(fn, warmup=25, rep=150, return_mode="median")
        except Exception as e:  # a config that does not compile (shared memory) is skipped
            return f"failed: {type(e).__name__}"

    def best(rows):
        ok = [r for r in rows if isinstance(r["ms"], float)]
        return min(ok, key=lambda r: r["ms"])["cfg"]

    for c in fwd_c:
        cfg = dataclasses.replace(base, fwd_m=c[0], fwd_n=c[1], fwd_warps=c[2], fwd_stages=c[3])
        res["fwd"].append({"cfg": c, "ms": bench(lambda: at.forward(q, k, v, causal, sc, cfg))})
        print("sweep fwd", res["fwd"][-1], flush=True)
    f = best(res["fwd"])
    base = dataclasses.replace(base, fwd_m=f[0], fwd_n=f[1], fwd_warps=f[2], fwd_stages=f[3])
    if only_fwd:
        res["best"] = base.to_dict()
        print("sweep best", res["best"], flush=True)
        return res
    o, lse = at.forward(q, k, v, causal, sc, base)
    for c in kv_c:
        cfg = dataclasses.replace(base, kv_m=c[0], kv_n=c[1], kv_warps=c[2], kv_stages=c[3])
        res["kv"].append({"cfg": c, "ms": bench(lambda: atb.backward(do, q, k, v, o, lse, causal, sc, cfg))})
        print("sweep bwd (dk/dv tiles)", res["kv"][-1], flush=True)
    c = best(res["kv"])
    base = dataclasses.replace(base, kv_m=c[0], kv_n=c[1], kv_warps=c[2], kv_stages=c[3])
    for c in q_c:
        cfg = dataclasses.replace(base, q_m=c[0], q_n=c[1], q_warps=c[2], q_stages=c[3])
        res["q"].append({"cfg": c, "ms": bench(lambda: atb.backward(do, q, k, v, o, lse, causal, sc, cfg))})
        print("sweep bwd (dq tiles)", res["q"][-1], flush=True)
    c = best(res["q"])
    base = dataclasses.replace(base, q_m=c[0], q_n=c[1], q_warps=c[2], q_stages=c[3])
    res["best"] = base.to_dict()
    print("sweep best", res["best"], flush=True)
    return res


def _strip_n(d: dict | None) -> dict | None:
    return None if d is None else {k: v for k, v in d.items() if k != "n"}


def _fmt_ok(d: dict | None) -> str:
    if d is None:
        return "-"
    return "yes" if all(d.values()) else "NO(" + ",".join(n for n, ok in d.items() if not ok) + ")"


def main(argv=None) -> dict:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.sass:
        from benchmarks.attention_sass import main_sass

        return main_sass(args)
    if args.configs:
        from benchmarks.attention_configs import run

        return run(args)
    import torch
    import torch.nn.functional as F
    import triton

    dtype = getattr(torch, DTYPES[args.dtype])
    B, H, S, D = args.batch, args.heads, args.seq, args.dim
    Hk = args.kv_heads or H
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "shape": [B, H, Hk, S, D],
            "dtype": str(dtype), "causal": not args.no_causal}
    print(json.dumps(meta), flush=True)
    q, k, v, do = _inputs(torch, B, H, Hk, S, D, dtype, seed=0)
    result = {"meta": meta, "backends": {}}
    if args.sweep:
        result["sweep"] = _sweep(torch, q, k, v, do, not args.no_causal, only_fwd=args.sweep == "fwd")
        if not args.keep_config:
            # the table below then times the best tiles found here (say so where it is reported)
            from tpdiag.kernels import attention_triton as at

            at.HEAD_DIM_CONFIGS[(dtype, D)] = at.AttnConfig(**result["sweep"]["best"])
    from tpdiag.kernels import attention_triton as _at, attention_triton_bwd as _atb

    result["invariant_config"] = _at.config_for(dtype, D).to_dict()
    print("invariant-triton tiles", result["invariant_config"], flush=True)
    backends = _backends(args, torch, F)
    shipped = None  # the shipped kernels' outputs, for the variants' bits
    for name, f in backends.items():
        row = {}
        try:
            t0 = time.time()
            row["fwd_ms"], row["fwdbwd_ms"] = _time(torch, f, q, k, v, do)
            if not args.no_checks:
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    row.update(_checks(torch, f, q, k, v, do))
                    if name.startswith("invariant") and args.reruns > 1:
                        row["reruns"] = {"n": args.reruns, **_reruns(torch, f, q, k, v, do, args.reruns)}
                    if name.startswith("invariant["):
                        # whether the variant keeps the shipped bits: a change of warps or stages
                        # keeps every sum's order and should; a change of key-block size does not
                        if shipped is None:
                            shipped = _run(torch, backends["invariant-triton"], q, k, v, do)
                        row["same_bits_as_shipped"] = {n: _eq(torch, a, b) for n, a, b in zip(
                            ("o", "dq", "dk", "dv"), _run(torch, f, q, k, v, do), shipped)}
                finally:
                    torch.use_deterministic_algorithms(False)
                row["rel_err"] = _rel_err(torch, f, args, dtype)
            row["seconds"] = round(time.time() - t0, 1)
        except Exception as e:  # report and go on: one backend missing must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        result["backends"][name] = row
        print(name, json.dumps(row), flush=True)
    # the same kernels called directly, without autograd: how much of fwd+bwd is the Function
    try:
        from triton.testing import do_bench

        sc = 1.0 / math.sqrt(D)

        def direct():
            o, lse = _at.forward(q, k, v, not args.no_causal, sc)
            _atb.backward(do, q, k, v, o, lse, not args.no_causal, sc)
        result["invariant_direct_fwdbwd_ms"] = do_bench(direct, warmup=50, rep=300, return_mode="median")
        print("invariant-triton direct fwd+bwd (no autograd) ms", result["invariant_direct_fwdbwd_ms"], flush=True)
    except Exception as e:
        print("direct timing failed:", type(e).__name__, e, flush=True)
    if not args.no_checks:
        # the shipped kernel at GQA and fp32 too (checks only, smaller shapes)
        from tpdiag.kernels.attention import invariant_sdpa

        f = lambda q, k, v: invariant_sdpa(q, k, v, is_causal=not args.no_causal,  # noqa: E731
                                          enable_gqa=q.shape[1] != k.shape[1])
        extra = {}
        for tag, shp, dt in (("gqa-bf16-B2H32Hk8S1024D128", (2, 32, 8, 1024, 128), dtype),
                             ("gqa-fp32-B2H16Hk8S512D64", (2, 16, 8, 512, 64), torch.float32),
                             ("mha-fp32-B2H8S1000D64", (2, 8, 8, 1000, 64), torch.float32)):
            try:
                ins = _inputs(torch, *shp, dt, seed=3)
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    extra[tag] = _checks(torch, f, *ins)
                finally:
                    torch.use_deterministic_algorithms(False)
            except Exception as e:
                extra[tag] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print("invariant-triton", tag, json.dumps(extra[tag]), flush=True)
        result["invariant_extra"] = extra
    stock = [r["fwdbwd_ms"] for n, r in result["backends"].items() if n.startswith("sdpa-") and "fwdbwd_ms" in r]
    fastest = min(stock) if stock else None
    lines = [f"{'backend':20} {'fwd ms':>8} {'fwd+bwd':>8} {'ratio':>6} {'TP2':>5} {'TP4':>5} {'TP8':>5} "
             f"{'batch':>6} {'repro':>10} {'reruns':>7} {'rel err o/dq/dk/dv':>28}"]
    for n, r in result["backends"].items():
        if "error" in r:
            lines.append(f"{n:20} error: {r['error']}")
            continue
        ratio = r["fwdbwd_ms"] / fastest if fastest else float("nan")
        r["ratio_to_fastest_stock"] = ratio
        hs = r.get("heads", {})
        err = "/".join(f"{r['rel_err'][x]:.1e}" for x in ("o", "dq", "dk", "dv")) if "rel_err" in r else "-"
        lines.append(f"{n:20} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {ratio:6.3f} {_fmt_ok(hs.get(2)):>5} "
                     f"{_fmt_ok(hs.get(4)):>5} {_fmt_ok(hs.get(8)):>5} {_fmt_ok(r.get('batch')):>6} "
                     f"{_fmt_ok(r.get('repro')):>10} {_fmt_ok(_strip_n(r.get('reruns'))):>7} {err:>28}")
    result["fastest_stock_ms"] = fastest
    return emit(result, lines, args.json)


if __name__ == "__main__":
    main()
