"""On a CUDA GPU: where the pre-split bf16 GEMM's error comes from. Rel. error vs float64 of
  - a bf16 x bf16 product with an fp32 result (triton_mm and cuBLAS): tensor-core accumulation
  - the split pieces (Triton kernel == torch split, and x0 + x1 + x2 == x exactly)
  - split_mm bf16x6 / bf16x9 with and without PROMOTE (per-K-step partial sums added on FMA units)
and the time of each split_mm variant against cuBLAS fp32 at 4096^3.

  python -m benchmarks split-gemm        # CUDA only (exit 3 without)
"""
import argparse

from benchmarks.errors import require_cuda


def rel(c, ref):
    return ((c.double() - ref).norm() / ref.norm()).item()


def main(argv: list[str]) -> dict:
    argparse.ArgumentParser(prog="benchmarks split-gemm", description=__doc__.splitlines()[0]).parse_args(argv)
    require_cuda("split-gemm")
    import torch
    from triton.testing import do_bench

    from tpdiag.kernels import invariant_gemm as ig
    from tpdiag.kernels import split_gemm as sg
    from tpdiag.kernels.invariant_gemm_config import GemmConfig

    fig = {"shape": "4096^3", "variants": []}
    torch.manual_seed(0)
    M = K = N = 4096
    a = torch.randn(M, K, device="cuda")
    b = torch.randn(K, N, device="cuda")
    ref = a.double() @ b.double()
    ab, bb = a.bfloat16(), b.bfloat16()
    refb = ab.double() @ bb.double()
    print(f"bf16 x bf16 -> fp32, triton_mm: rel err {rel(ig.triton_mm(ab, bb, out_dtype=torch.float32), refb):.2e}")
    print(f"bf16 x bf16 -> fp32 via cuBLAS bf16 inputs upcast to fp32 (IEEE FMA): "
          f"rel err {rel(torch.matmul(ab.float(), bb.float()), refb):.2e}")
    pt = sg.split_bf16_torch(a)
    pk = sg.split_bf16(a)
    same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(pt, pk))
    exact = torch.equal(pk[0].float() + pk[1].float() + pk[2].float(), a)
    print(f"split: Triton kernel == torch split: {same}; x0 + x1 + x2 == x exactly: {exact}")
    t_cublas = do_bench(lambda: torch.matmul(a, b), warmup=25, rep=100)
    e_cublas = rel(torch.matmul(a, b), ref)
    print(f"cuBLAS fp32: rel err {e_cublas:.2e}, {t_cublas:.3f} ms")
    fig.update(split_kernel_equals_torch=same, split_exact=exact, cublas_ms=t_cublas, cublas_rel_err=e_cublas)
    for prec in ("bf16x6", "bf16x9"):
        for promote in (False, True):
            cfg = GemmConfig(128, 128, 32, 8, 8, 3, tma=True, epilogue_subtile=True, fp32_precision=prec)
            fn = lambda: sg.split_mm(a, b, cfg, torch.float32, ig._num_sms(0), promote=promote)  # noqa: E731
            c = fn()
            t = do_bench(fn, warmup=25, rep=100)
            inv = torch.equal(sg.split_mm(a[3:100], b, cfg, torch.float32, ig._num_sms(0), promote=promote), c[3:100])
            print(f"split_mm {prec} promote={promote}: rel err {rel(c, ref):.2e}, {t:.3f} ms = "
                  f"{100 * t_cublas / t:.0f}% of cuBLAS, rows 3:100 bitwise: {inv}")
            fig["variants"].append({"precision": prec, "promote": promote, "rel_err": rel(c, ref), "ms": t,
                                    "of_cublas": t_cublas / t, "rows_bitwise": inv})
    fig["ok"] = same and exact and all(v["rows_bitwise"] for v in fig["variants"])
    return fig
