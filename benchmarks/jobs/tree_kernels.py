"""GPU check of the tree fixes' Triton kernels: bitwise TP invariance, float64 accuracy, speed.

On one CUDA GPU, at realistic shapes (T=4096 tokens, vocab 128256, hidden 4096; bf16 and fp32):
  * invariant-vocab-softmax  vocab_ce_triton.group_exp_sums
  * invariant-norm-grad      norm_grad_triton.group_col_sums / row_rstd / row_dot_mean, RMSNormSP
  * tp-invariant-linear      RowLinearPartial and the column tree dgrad, group GEMMs on triton_mm
Each is computed as one TP=1-sized call (all 8 groups) and as the rank slices of TP=2/4/8 calls
(one process: the cross-rank tree is finished here), plus on a slice of rows; every group / row
must have the same bits. Accuracy against the float64 references; the stock reductions (one sum
per rank over its whole shard, ranks added in order) are reported as a control, not asserted.
Timing: Triton path vs the torch path that runs without it (medians, triton.testing.do_bench).

    python -m benchmarks tree-kernels [--out DIR]            # one GPU, < 2 min
    python -m benchmarks tree-kernels --smoke [--out DIR]    # CPU, interpreter

Writes DIR/tree_kernels.md and DIR/tree_kernels.json (DIR: --out, else $OUT, else only
stdout); exits 1 if an invariance or accuracy check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

G = 8  # TPDIAG_TREE_GROUPS default: the largest TP the tree supports
TPS = (2, 4, 8)
RTOL = 1e-5  # float64 accuracy bar for the fp32 sums (the GPU's exp / rsqrt are approximate)


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks tree-kernels", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for tree_kernels.md / .json")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--dtypes", default="bf16,fp32")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict:
    args = parse(argv)
    if args.smoke:  # before triton is imported (python -m benchmarks sets them before this module)
        os.environ.update(TPDIAG_TRITON_CPU="1", TRITON_INTERPRET="1")
    import torch

    from benchmarks.errors import require_cuda

    from tpdiag.kernels import grouped_linear as gl, norm_grad as ng, norm_grad_triton as nt
    from tpdiag.kernels import tree, vocab_ce, vocab_ce_triton as vt

    dev = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke:
        require_cuda("tree-kernels", "--smoke runs it on CPU under the Triton interpreter")
    shp = (dict(T=16, V=G * 24, D=32, heads=16, hd=8, K=256, N=48) if args.smoke else
           dict(T=4096, V=128256, D=4096, heads=32, hd=128, K=4096, N=4096))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    iv = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    gen = torch.Generator(device=dev).manual_seed(0)
    checks, timings = [], []

    def randn(*s, dt=torch.float32, scale=1.0):
        return (torch.randn(*s, generator=gen, device=dev) * scale).to(dt)

    def ndiff(x, y):
        """Elements whose bits differ (-1: shapes/dtypes differ)."""
        if x.shape != y.shape or x.dtype != y.dtype:
            return -1
        return int((x.contiguous().view(iv[x.dtype]) != y.contiguous().view(iv[y.dtype])).sum())

    def check(name, n, what="bitwise"):
        checks.append(dict(check=name, kind=what, differing=n, ok=n == 0))

    def accuracy(name, err, tol):
        checks.append(dict(check=name, kind="float64", err=err, tol=tol, ok=err < tol))

    def control(name, n):
        checks.append(dict(check=name, kind="control (stock)", differing=n, ok=None))

    def bench(fn):
        if dev.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    def timed(name, tri, ref):
        a, b = bench(tri), bench(ref)
        timings.append(dict(op=name, triton_ms=a, torch_ms=b, speedup=b / a))

    @contextlib.contextmanager
    def torch_path():
        """Every tree kernel on its torch path (what runs without Triton)."""
        saved = vt.triton_path, nt.triton_path, gl.triton_path
        off = lambda t: False  # noqa: E731
        vt.triton_path = nt.triton_path = gl.triton_path = off
        try:
            yield
        finally:
            vt.triton_path, nt.triton_path, gl.triton_path = saved

    def timed_paths(name, fn):
        """The same call timed on the Triton path and on the torch path it replaces."""
        with torch_path():
            t_torch = bench(fn)
        t_tri = bench(fn)
        timings.append(dict(op=name, triton_ms=t_tri, torch_ms=t_torch, speedup=t_torch / t_tri))

    def rank_order(parts):
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc

    T = shp["T"]

    def vocab_section(dn, dt):
        V = shp["V"]
        # ---------------- invariant-vocab-softmax ----------------
        lo = randn(T, V, dt=dt, scale=4.0)
        m = lo.float().max(-1).values
        full = vt.group_exp_sums(lo, m, G)
        ref = vt.reference_group_exp_sums(lo, m, G)
        accuracy(f"vocab {dn}: group sums vs float64 (max rel)", float(((full.double() - ref).abs() / ref).max()), RTOL)
        for tp in TPS:
            k = G // tp
            check(f"vocab {dn}: TP={tp} rank groups == TP=1", sum(
                ndiff(vt.group_exp_sums(c.contiguous(), m, k), full[r * k:(r + 1) * k])
                for r, c in enumerate(lo.chunk(tp, -1))))
        i, j = T // 4 + 3, T // 2 + 1
        check(f"vocab {dn}: rows {i}:{j} and row {i} == full call",
              ndiff(vt.group_exp_sums(lo[i:j], m[i:j], G), full[:, i:j])
              + ndiff(vt.group_exp_sums(lo[i:i + 1], m[i:i + 1], G), full[:, i:i + 1]))
        e = torch.exp(lo.float() - m[:, None])
        whole = e.sum(-1)
        control(f"vocab {dn}: stock per-rank .sum + rank-order add, TP=2/4/8 vs TP=1 (rows)",
                sum(ndiff(rank_order([c.contiguous().sum(-1) for c in e.chunk(tp, -1)]), whole) for tp in TPS))
        torch_full = vocab_ce.torch_group_exp_sums(lo.float(), m, G)
        check(f"vocab {dn}: torch path, TP=8 rank groups == TP=1", sum(
            ndiff(vocab_ce.torch_group_exp_sums(c.float(), m, 1)[0], torch_full[r])
            for r, c in enumerate(lo.chunk(8, -1))))
        lab = torch.randint(0, V, (T,), generator=gen, device=dev)
        lp = vocab_ce.token_logprobs(lo, lab, G)
        accuracy(f"vocab {dn}: token logprobs vs float64 (max abs)",
                 float((lp.double() - vocab_ce.reference_logprobs(lo, lab)).abs().max()), 1e-4)
        for tp in (1, 8):
            sh = lo[:, :V // tp].contiguous()
            shf = sh.float()
            timed(f"vocab {dn} group sums, T={T}, V_local={V // tp}",
                  lambda: vt.group_exp_sums(sh, m, G // tp),
                  lambda: vocab_ce.torch_group_exp_sums(shf, m, G // tp))
        fwd = lambda: vocab_ce.token_logprobs(lo, lab, G)  # noqa: E731
        timed_paths(f"vocab {dn} token_logprobs forward, TP=1", fwd)

    def norm_section(dn, dt):
        D = shp["D"]
        for label, shape, gd in (("SP", (1, T, D), 1), ("per-head", (1, T, shp["heads"], shp["hd"]), -2)):
            a, b = randn(*shape, dt=dt), randn(*shape, dt=dt)
            full = nt.group_col_sums(a, b, G, gd)
            ref = nt.reference_group_col_sums(a, b, G, gd)
            accuracy(f"norm {dn} {label}: dgamma group sums vs float64 (max abs / max)",
                     float((full.double() - ref).abs().max() / ref.abs().max()), RTOL)
            for tp in TPS:
                k = G // tp
                check(f"norm {dn} {label}: TP={tp} rank groups == TP=1", sum(
                    ndiff(nt.group_col_sums(ca, cb, k, gd), full[r * k:(r + 1) * k])
                    for r, (ca, cb) in enumerate(zip(a.chunk(tp, gd), b.chunk(tp, gd)))))
            r_full, d_full = nt.row_rstd(a, 1e-5), nt.row_dot_mean(a, b)
            rr = nt.reference_row_rstd(a, 1e-5)
            accuracy(f"norm {dn} {label}: rstd vs float64 (max rel)", float(((r_full.double() - rr) / rr).abs().max()),
                     RTOL)
            sl = (slice(None), slice(3, T // 2 + 1))
            check(f"norm {dn} {label}: rstd / dot rows, row slice and TP slices == full call",
                  ndiff(nt.row_rstd(a[sl], 1e-5), r_full[sl]) + ndiff(nt.row_dot_mean(a[sl], b[sl]), d_full[sl])
                  + sum(ndiff(nt.row_rstd(c, 1e-5), rc) for c, rc in zip(a.chunk(8, gd), r_full.chunk(8, gd))))
            terms = a.float() * b.float()
            dims = tuple(range(terms.dim() - 1))
            control(f"norm {dn} {label}: stock per-rank dgamma .sum + rank-order add vs TP=1 (columns)",
                    sum(ndiff(rank_order([c.contiguous().sum(dims) for c in terms.chunk(tp, gd)]), terms.sum(dims))
                        for tp in TPS))

            def torch_dgamma(a=a, b=b, gd=gd):
                t = a.float() * b.float()
                return [c.contiguous().sum(dim=tuple(range(t.dim() - 1))) for c in t.chunk(G, dim=gd)]

            timed(f"norm {dn} {label} dgamma group sums {tuple(shape)}", lambda: nt.group_col_sums(a, b, G, gd),
                  torch_dgamma)
            timed(f"norm {dn} {label} rstd {tuple(shape)}", lambda: nt.row_rstd(a, 1e-5),
                  lambda: torch.cat([torch.rsqrt(c.float().pow(2).mean(-1, keepdim=True) + 1e-5)
                                     for c in a.chunk(G, gd)], gd))
        # RMSNormSP end to end at simulated TP (sequence-parallel): y, dx, dgamma
        x, gy = randn(1, T, D, dt=dt), randn(1, T, D, dt=dt)
        w = (torch.rand(D, generator=gen, device=dev) + 0.5).to(dt)
        outs = {}
        for world in (1,) + TPS:
            ys, dxs, dws = [], [], []
            for xr, gr in zip(x.chunk(world, 1), gy.chunk(world, 1)):
                xr = xr.contiguous().requires_grad_(True)
                wr = w.float().clone().requires_grad_(True)  # fp32 dgamma roots: tree finished below
                y = ng.RMSNormSP.apply(xr, wr, 1e-5, G // world, 1)
                y.backward(gr.to(y.dtype))
                ys.append(y.detach())
                dxs.append(xr.grad)
                dws.append(wr.grad)
            outs[world] = (torch.cat(ys, 1), torch.cat(dxs, 1), tree.tree_sum(dws))
        check(f"norm {dn}: RMSNormSP y, dx, dgamma at TP=2/4/8 == TP=1",
              sum(ndiff(outs[wd][i], outs[1][i]) for wd in TPS for i in range(3)))

        xb, wb = x.clone().requires_grad_(True), w.float().clone().requires_grad_(True)

        def rms_step():
            xb.grad = wb.grad = None
            ng.RMSNormSP.apply(xb, wb, 1e-5, G, 1).backward(gy.float())

        timed_paths(f"norm {dn} RMSNormSP fwd+bwd (1, {T}, {D})", rms_step)

    def linear_section(dn, dt):
        K, N = shp["K"], shp["N"]
        xl, wl, gl_ = randn(T, K, dt=dt), randn(N, K, dt=dt, scale=K ** -0.5), randn(T, N)
        outs = {}
        for world in (1,) + TPS:
            ys, dxs, dws = [], [], []
            for xr, wr in zip(xl.chunk(world, -1), wl.chunk(world, -1)):
                xr, wr = xr.contiguous().requires_grad_(True), wr.contiguous().requires_grad_(True)
                y = gl.RowLinearPartial.apply(xr, wr, G // world)
                y.backward(gl_)
                ys.append(y.detach())
                dxs.append(xr.grad)
                dws.append(wr.grad)
            outs[world] = (tree.tree_sum(ys), torch.cat(dxs, -1), torch.cat(dws, -1))
        check(f"linear {dn}: row-parallel y, dx, dw at TP=2/4/8 == TP=1",
              sum(ndiff(outs[wd][i], outs[1][i]) for wd in TPS for i in range(3)))
        i, j = 5, T // 2 + 3
        check(f"linear {dn}: row-parallel rows {i}:{j} == full call",
              ndiff(gl.RowLinearPartial.apply(xl[i:j], wl, G), outs[1][0][i:j]))
        ref = gl.reference_linear(xl, wl)
        accuracy(f"linear {dn}: row-parallel vs float64 (norm rel)",
                 float((outs[1][0].double() - ref).norm() / ref.norm()), RTOL)
        full = xl @ wl.t()
        control(f"linear {dn}: stock per-rank GEMM + rank-order add vs TP=1 (elements)",
                sum(ndiff(rank_order([a @ b.t() for a, b in zip(xl.chunk(tp, -1), wl.chunk(tp, -1))]), full)
                    for tp in TPS))
        # column-parallel tree dgrad: what ColLinear.backward computes before tree_all_reduce
        wc = randn(N, K, dt=dt, scale=K ** -0.5)
        dy = randn(T, N, dt=dt)
        douts = {}
        for world in (1,) + TPS:
            parts = [tree.tree_sum([gl._mm(gg.float().contiguous(), wg.float().contiguous())
                                    for gg, wg in zip(dr.chunk(G // world, -1), wr.chunk(G // world, 0))])
                     for wr, dr in zip(wc.chunk(world, 0), dy.chunk(world, -1))]
            douts[world] = tree.tree_sum(parts) if world > 1 else parts[0]
        check(f"linear {dn}: column tree dgrad at TP=2/4/8 == TP=1", sum(ndiff(douts[wd], douts[1]) for wd in TPS))
        fwd = lambda: gl.RowLinearPartial.apply(xl, wl, G)  # noqa: E731
        timed_paths(f"linear {dn} RowLinearPartial fwd, 8 groups, [{T},{K}]x[{K},{N}]", fwd)

    # One function per fix: its big tensors are freed when it returns.
    for dn in args.dtypes.split(","):
        for section in (vocab_section, norm_section, linear_section):
            section(dn, dtypes[dn])
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    report = dict(device=dev_name, torch=torch.__version__, shapes=shp, groups=G, smoke=args.smoke,
                  checks=checks, timings=timings, ok=all(c["ok"] is not False for c in checks))
    write(args.out, report)
    return {"ok": report["ok"], "device": dev_name, "shapes": shp, "checks": len(checks),
            "failed": [c["check"] for c in checks if c["ok"] is False],
            "timings": {t["op"]: {"triton_ms": t["triton_ms"], "torch_ms": t["torch_ms"]} for t in timings}}


def write(out: str | None, report: dict) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tree_kernels.json"), "w") as f:
            json.dump(report, f, indent=1)
    lines = [f"# Tree-fix Triton kernels on {report['device']}", "",
             f"torch {report['torch']}, shapes {report['shapes']}, {report['groups']} groups, "
             f"overall: {'PASS' if report['ok'] else 'FAIL'}", ""]
    if report["smoke"]:
        lines += ["Smoke run (CPU, Triton interpreter): the timings say nothing about GPU speed.", ""]
    lines += ["| check | kind | result |", "|---|---|---|"]
    for c in report["checks"]:
        if c["kind"] == "float64":
            res = f"{c['err']:.2e} (< {c['tol']:.0e}) {'ok' if c['ok'] else 'FAIL'}"
        elif c["ok"] is None:
            res = f"{c['differing']} differ (stock reference, not asserted)"
        else:
            res = "bitwise equal" if c["ok"] else f"FAIL: {c['differing']} differ"
        lines.append(f"| {c['check']} | {c['kind']} | {res} |")
    lines += ["", "| op | Triton ms | torch ms | torch / Triton |", "|---|---|---|---|"]
    for t in report["timings"]:
        lines.append(f"| {t['op']} | {t['triton_ms']:.3f} | {t['torch_ms']:.3f} | {t['speedup']:.2f}x |")
    text = "\n".join(lines) + "\n"
    if out:
        with open(os.path.join(out, "tree_kernels.md"), "w") as f:
            f.write(text)
    print(text)
