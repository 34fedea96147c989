"""On a CUDA GPU: tp-invariant-linear's per-rank group GEMM at llama-1b shapes (TP=2, batch 8 x
seq 4096): cuBLAS stock bf16 (what the fix replaces), one invariant-gemm call per K group with
fp32 outputs + tree_sum (the previous implementation) and tree_mm (the groups' tree in registers)
for a sweep of tiles; every tree_mm variant checked bitwise against the TP decomposition.

  python -m benchmarks tree-gemm        # CUDA only (exit 3 without)
"""
import argparse

from benchmarks.errors import require_cuda

TILES = [(128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
         (64, 64, 64, 4, 4), (128, 128, 32, 8, 4)]


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="benchmarks tree-gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    args = ap.parse_args(argv)
    require_cuda("tree-gemm")
    import torch
    from triton.testing import do_bench

    from tpdiag.kernels.invariant_gemm import triton_mm
    from tpdiag.kernels.tree import tree_sum, tree_sum_stacked
    from tpdiag.kernels.tree_gemm import tree_mm

    torch.manual_seed(0)
    M, G = args.tokens, 4
    # (name, a, b): row-parallel forward (x_local @ w_local.t(), w [N, K_r]) and column dgrad
    cases = []
    for name, k, n, transposed in (("wo fwd", 1024, 2048, True), ("w2 fwd", 2816, 2048, True),
                                   ("w1 dgrad", 2816, 2048, False)):
        a = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if transposed
             else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
        cases.append((name, a, b))
    rows = []
    for name, a, b in cases:
        k = a.shape[1] // G
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        t_cublas = do_bench(lambda: a @ b, warmup=10, rep=50)

        def groups():
            return tree_sum([triton_mm(a[:, i * k:(i + 1) * k], b[i * k:(i + 1) * k],
                                       out_dtype=torch.float32) for i in range(G)])
        t_groups = do_bench(groups, warmup=10, rep=50)
        row = {"case": name, "cublas_ms": t_cublas, "groups_ms": t_groups, "tiles": {}}
        print(f"{name}: [{a.shape[0]}x{a.shape[1]}] @ [{b.shape[0]}x{b.shape[1]}], {G} groups: cuBLAS "
              f"{t_cublas:.3f} ms ({flops / t_cublas / 1e9:.0f} TFLOP/s); per-group triton_mm + tree "
              f"{t_groups:.3f} ms ({t_groups / t_cublas:.2f}x)")
        for tiles in TILES:
            try:
                whole = tree_mm(a, b, G, tiles=tiles)
                halves = torch.stack([tree_mm(a[:, h * 2 * k:(h + 1) * 2 * k], b[h * 2 * k:(h + 1) * 2 * k],
                                              G // 2, tiles=tiles) for h in range(2)])
                ok = torch.equal(tree_sum_stacked(halves).view(torch.int32), whole.view(torch.int32))
                t = do_bench(lambda: tree_mm(a, b, G, tiles=tiles), warmup=10, rep=50)
            except Exception as e:  # a tile that does not compile (shared memory) is a row, not a stop
                print(f"  tree_mm {tiles}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            row["tiles"][str(tiles)] = {"ms": t, "bitwise_tp2": ok}
            print(f"  tree_mm {tiles}: {t:.3f} ms ({t / t_cublas:.2f}x cuBLAS, "
                  f"{flops / t / 1e9:.0f} TFLOP/s), TP=2 halves bitwise: {ok}")
        rows.append(row)
    return {"cases": rows, "ok": all(v["bitwise_tp2"] for r in rows for v in r["tiles"].values())}
