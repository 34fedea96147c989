"""On a CUDA GPU: tp-invariant-linear's per-rank tree GEMM (`tree_mm`) at llama-1b shapes, batch 8
x seq 4096, against cuBLAS stock bf16 (what the fix replaces): the per-tile kernel (shipped) and
the persistent TMA kernel (tree_gemm_tma.py, opt-in);
every variant checked bitwise (the rank's root = the tree over its halves' roots; a row's bits
do not depend on M). Timings: median over --rounds rounds (variants interleaved in each round)
of triton.testing.do_bench medians, with the spread; the sum over one training step's calls.

Beside them, at the same per-rank shapes, the ONE-group path (tree groups G = the degree, the
default of a compare whose largest degree it is): the rank's whole product is one invariant
GEMM with fp32 output (triton_mm), checked bitwise against the same call on TP=1's strided group
slice of the whole K (what TP=1 computes per group) and on a row slice.

  python -m benchmarks tree-gemm                 # shipped tiles, TP=2 and TP=4 shapes, step sums
  python -m benchmarks tree-gemm --sweep         # TMA tile configs at three TP=2 and TP=4 shapes
  python -m benchmarks tree-gemm --loops         # + the per-tile kernel's loops (a pair of
                                                 #   groups a loop, spill) at a few tiles,
                                                 #   each checked == a loop per group's bits
"""
import argparse
import functools
import statistics

from benchmarks.errors import require_cuda

PEAK = 989.4e12  # H100/H200 SXM dense bf16

# (name, K per rank at TP=1, N, weight layout: row-parallel forward = x @ w.t() with w [N, K];
# column dgrad = g @ w with w [K, N]), calls per step (llama-1b: 16 layers, wq wk wv w1 w3
# column-parallel, wo w2 row-parallel, the vocab projection column-parallel)
SHAPES = (("wo fwd", 2048, 2048, True, 16), ("w2 fwd", 5632, 2048, True, 16),
          ("wq dgrad", 2048, 2048, False, 16), ("wk/wv dgrad", 1024, 2048, False, 32),
          ("w1/w3 dgrad", 5632, 2048, False, 32), ("lm dgrad", 32000, 2048, False, 1))
# invariant-gemm (triton_mm) at the column-parallel forward / wgrad shapes (name, M, K, N at TP=1,
# sharded dim, calls per step)
ONE_GROUP = "one group (G=TP): triton_mm fp32 out"
INV_SHAPES = (("wq fwd", "tok", 2048, 2048, "n", 16), ("w1/w3 fwd", "tok", 2048, 5632, "n", 32),
              ("wq wgrad", 2048, "tok", 2048, "m", 16), ("w1/w3 wgrad", 5632, "tok", 2048, "m", 32))
G = 8
# --loops: (groups a loop, spill, per-tile kernel tiles)
LOOP_VARIANTS = ((2, False, (128, 64, 64, 8, 3)),
                 (2, True, (128, 64, 64, 8, 3)), (2, True, (128, 128, 64, 8, 3)),
                 (2, True, (128, 128, 64, 8, 2)), (2, False, (128, 128, 64, 8, 3)),
                 (1, False, (128, 128, 64, 8, 3)), (1, False, (128, 128, 64, 8, 4)))


def _sweep_tiles():
    from tpdiag.kernels.tree_gemm_tma import TreeTiles

    k = (64, 32, 16)
    return [TreeTiles(128, 128, k, 8, 4), TreeTiles(128, 128, k, 8, 4, nested_if=True),
            TreeTiles(128, 128, k, 8, 3), TreeTiles(128, 128, k, 8, 3, nested_if=True),
            TreeTiles(128, 128, k, 8, 4, epilogue_subtile=False),
            TreeTiles(128, 128, k, 8, 4, epilogue_subtile=False, nested_if=True)]


def _bench(fns: dict, rounds: int) -> dict:
    from triton.testing import do_bench

    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=5, rep=25))
    return {name: {"ms": statistics.median(t), "min": min(t), "max": max(t)} for name, t in times.items()}


def _bits_ok(tree_mm, a, b, groups, tiles) -> bool:
    import torch

    from tpdiag.kernels.tree import tree_sum_stacked

    whole = tree_mm(a, b, groups, tiles=tiles)
    ok = True
    if groups > 1:
        k = a.shape[1] // 2
        halves = torch.stack([tree_mm(a[:, h * k:(h + 1) * k], b[h * k:(h + 1) * k], groups // 2,
                                      tiles=tiles) for h in range(2)])
        ok = torch.equal(tree_sum_stacked(halves).view(torch.int32), whole.view(torch.int32))
    rows = tree_mm(a[3:1000], b, groups, tiles=tiles)  # other M, rows at other tile positions
    return ok and torch.equal(rows.view(torch.int32), whole[3:1000].view(torch.int32))


def _one_group_bits_ok(triton_mm, a, b, transposed) -> bool:
    """The rank's one-group call == TP=1's call on its group: the same K range cut out of a
    wider (strided) operand; and a row's bits do not depend on M."""
    import torch

    f32 = torch.float32
    whole = triton_mm(a, b, out_dtype=f32)
    k = a.shape[1]
    aw = torch.empty(a.shape[0], 2 * k, dtype=a.dtype, device=a.device)
    aw[:, k:] = a
    if transposed:  # b = w.t(), w [N, K]: TP=1's group is w[:, g*k:(g+1)*k].t()
        ww = torch.empty(b.shape[1], 2 * k, dtype=b.dtype, device=b.device)
        ww[:, k:] = b.t()
        bs = ww.t()[k:]
    else:
        bw = torch.empty(2 * k, b.shape[1], dtype=b.dtype, device=b.device)
        bw[k:] = b
        bs = bw[k:]
    ok = torch.equal(triton_mm(aw[:, k:], bs, out_dtype=f32).view(torch.int32), whole.view(torch.int32))
    rows = triton_mm(a[3:1000], b, out_dtype=f32)
    return ok and torch.equal(rows.view(torch.int32), whole[3:1000].view(torch.int32))


def _operands(tokens, k, n, transposed, device="cuda"):
    import torch

    a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16).t() if transposed
         else torch.randn(k, n, device=device, dtype=torch.bfloat16))
    return a, b


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="benchmarks tree-gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--sweep", action="store_true", help="TMA tile configs at three shapes per TP")
    ap.add_argument("--loops", "--paired", action="store_true",
                    help="also the per-tile kernel's fused loops (groups a loop, spill) at a few tiles")
    args = ap.parse_args(argv)
    require_cuda("tree-gemm")
    import torch

    from tpdiag.kernels.invariant_gemm import triton_mm
    from tpdiag.kernels.tree_gemm import tree_mm
    from tpdiag.kernels.tree_gemm_tma import CUDA_TILES

    torch.manual_seed(0)
    M = args.tokens
    first = (128, 64, 64, 8, 3)  # the reference: a loop per group at tree_gemm._CUDA_TILES
    if args.sweep:
        variants = {"loop per group 128x64x64 w8 s3": ("loop", 1, False, first)}
        variants.update({_name(t): t for t in _sweep_tiles()})
        tps, shapes = [int(t) for t in args.tp.split(",")], [
            s for s in SHAPES if s[0] in ("wo fwd", "w2 fwd", "wk/wv dgrad")]
    else:
        # shipped: tree_gemm.LOOPS' loops and tiles for the group count
        variants = {"shipped": ("loop", None, None, None),
                    "loop per group 128x64x64 w8 s3": ("loop", 1, False, first),
                    "tma " + _name(CUDA_TILES[torch.bfloat16]): CUDA_TILES[torch.bfloat16]}
        tps, shapes = [int(t) for t in args.tp.split(",")], SHAPES
    if args.loops:
        for fuse, spill, t in LOOP_VARIANTS:
            variants[{1: "loop", 2: "pair"}[fuse] + (" spill " if spill else " ")
                     + "x".join(map(str, t[:3])) + f" w{t[3]} s{t[4]}"] = ("loop", fuse, spill, t)
    rows, ok = [], True
    for tp in tps:
        groups = G // tp
        for name, k, n, transposed, calls in shapes:
            a, b = _operands(M, k // tp, n, transposed)
            flops = 2 * M * (k // tp) * n
            fns, bits = {"cublas": lambda: a @ b}, {}
            for vname, tiles in variants.items():
                try:
                    if isinstance(tiles, tuple) and tiles[0] == "loop":
                        # a loop per group's bits at the first tiles, besides the tree's own checks
                        fn = functools.partial(tree_mm, fuse=tiles[1], spill=tiles[2])
                        bits[vname] = _bits_ok(fn, a, b, groups, tiles[3]) and torch.equal(
                            fn(a, b, groups, tiles=tiles[3]).view(torch.int32),
                            tree_mm(a, b, groups, tiles=first, fuse=1).view(torch.int32))
                        fns[vname] = (lambda t=tiles[3], f=fn: f(a, b, groups, tiles=t))
                        continue
                    bits[vname] = _bits_ok(tree_mm, a, b, groups, tiles)
                    fns[vname] = (lambda t=tiles: tree_mm(a, b, groups, tiles=t))
                except Exception as e:  # a config that does not compile is a row, not a stop
                    print(f"  {vname}: failed {type(e).__name__}: {str(e)[:160]}")
            if not args.sweep:
                bits[ONE_GROUP] = _one_group_bits_ok(triton_mm, a, b, transposed)
                fns[ONE_GROUP] = lambda: triton_mm(a, b, out_dtype=torch.float32)
            t = _bench(fns, args.rounds)
            cub = t["cublas"]["ms"]
            row = {"tp": tp, "case": name, "M": M, "K": k // tp, "N": n, "groups": groups,
                   "calls": calls, "cublas": t["cublas"], "cublas_tflops": flops / cub / 1e9,
                   "variants": {}}
            print(f"TP={tp} {name}: [{M}x{k // tp}] @ [{k // tp}x{n}], tree_mm {groups} groups (G={G}), "
                  f"{calls} calls/step: "
                  f"cuBLAS {cub:.3f} ms ({flops / cub / 1e9:.0f} TFLOP/s, MFU {flops / cub / 1e-3 / PEAK:.1%})")
            for vname in bits:
                v = t[vname]
                row["variants"][vname] = dict(v, x_cublas=v["ms"] / cub, bitwise=bits[vname])
                ok &= bits[vname]
                print(f"  {vname}: {v['ms']:.3f} ms ({v['min']:.3f}-{v['max']:.3f}) {v['ms'] / cub:.2f}x "
                      f"cuBLAS, {flops / v['ms'] / 1e9:.0f} TFLOP/s, bitwise {bits[vname]}")
            rows.append(row)
    steps = _step_sums(rows, variants)
    for tp, s in steps.items():
        print(f"TP={tp} one step's tree_mm calls: cuBLAS {s['cublas']:.1f} ms; " +
              "; ".join(f"{v} {ms:.1f} ms ({ms / s['cublas']:.2f}x)" for v, ms in s.items() if v != "cublas"))
    inv = [] if args.sweep else _invariant(M, tps, args.rounds)
    return {"tokens": M, "rows": rows, "step_ms": steps, "invariant_gemm": inv, "ok": ok,
            "shipped": CUDA_TILES[torch.bfloat16].to_dict()}


def _name(t) -> str:
    return (f"{t.block_m}x{t.block_n}x{t.block_k[0]} w{t.num_warps} s{t.num_stages} "
            f"gm{t.group_m}" + ("" if t.epilogue_subtile else " whole-epilogue")
            + (" nested-if" if t.nested_if else ""))


def _step_sums(rows, variants) -> dict:
    out = {}
    for r in rows:
        s = out.setdefault(r["tp"], {"cublas": 0.0})
        s["cublas"] += r["calls"] * r["cublas"]["ms"]
        for v, d in r["variants"].items():
            s[v] = s.get(v, 0.0) + r["calls"] * d["ms"]
    return out


def _invariant(M, tps, rounds) -> list:
    """invariant-gemm (triton_mm, bf16 out) vs cuBLAS at the column-parallel forward / wgrad."""
    import torch

    from tpdiag.kernels.invariant_gemm import triton_mm

    rows = []
    for tp in tps:
        for name, m, k, n, shard, calls in INV_SHAPES:
            m, k = (M if m == "tok" else m), (M if k == "tok" else k)
            if shard == "n":
                n //= tp
            else:
                m //= tp
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            if shard == "m":  # wgrad g.t() @ x: g is [tokens, N_r], so A is column-major
                a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t()
            t = _bench({"cublas": lambda: a @ b, "triton_mm": lambda: triton_mm(a, b)}, rounds)
            flops = 2 * m * k * n
            x = t["triton_mm"]["ms"] / t["cublas"]["ms"]
            print(f"TP={tp} invariant-gemm {name} [{m}x{k}] @ [{k}x{n}] ({calls}/step): cuBLAS "
                  f"{t['cublas']['ms']:.3f} ms ({flops / t['cublas']['ms'] / 1e9:.0f} TFLOP/s), triton_mm "
                  f"{t['triton_mm']['ms']:.3f} ms ({t['triton_mm']['min']:.3f}-{t['triton_mm']['max']:.3f}), {x:.2f}x")
            rows.append({"tp": tp, "case": name, "M": m, "K": k, "N": n, "calls": calls,
                         "cublas": t["cublas"], "triton_mm": t["triton_mm"], "x_cublas": x})
    return rows
