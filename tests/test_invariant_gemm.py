"""invariant-gemm: bitwise row (batch) and column-shard invariance, accuracy, negative controls.

Two implementations are checked with the same bitwise assertion:
  * cpu_mm (pure torch, no BLAS) through invariant_mm on CPU tensors, in this process;
  * the Triton kernels (pointer and TMA variants) under the Triton interpreter, in a
    subprocess, because TRITON_INTERPRET=1 must be set before triton is imported.
The negative controls run a reduction order that changes with the shape (split-K chosen by
M, as BLAS heuristics do) through the same assertion and require it to fail, so these
tests can fail. The only skip: triton not installed (interpreter tests).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tpdiag.kernels import invariant_gemm as ig

from conftest import interpreter_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IV = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def assert_bitwise(x: torch.Tensor, y: torch.Tensor, what: str = "") -> None:
    """Equal raw bits (so -0.0 vs +0.0 and NaN payloads count), not torch.equal on floats."""
    assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
    xb, yb = x.contiguous().view(IV[x.dtype]), y.contiguous().view(IV[y.dtype])
    n = int((xb != yb).sum())
    assert n == 0, f"{what}: {n} of {xb.numel()} elements differ bitwise"


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def operands(M, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    return a, b


# Odd K (129) exercises the tree's carried element; slices cross every chunk boundary.
M, K, N = 67, 129, 48
ROW_SLICES = [(0, 1), (5, 6), (3, 40), (33, 67), (0, 66), (17, 18), (1, 67)]


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TPDIAG_TRITON_CPU", raising=False)


def check_rows(mm, a, b):
    full = mm(a, b)
    for i, j in ROW_SLICES:
        assert_bitwise(mm(a[i:j], b), full[i:j], f"rows {i}:{j}")


def check_cols(mm, a, b, tp):
    full = mm(a, b)
    s = b.shape[1] // tp
    for r in range(tp):
        assert_bitwise(mm(a, b[:, r * s:(r + 1) * s]), full[:, r * s:(r + 1) * s], f"{tp}-way shard {r}")


# --------------------------------------------------------------------------------------
# CPU path (cpu_mm through the dispatcher)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cpu_rows_bitwise(dtype):
    a, b = operands(M, K, N, dtype)
    check_rows(ig.invariant_mm, a, b)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cpu_column_shards_bitwise(dtype, tp):
    a, b = operands(M, K, N, dtype)
    check_cols(ig.invariant_mm, a, b, tp)
    # Column-parallel linear layout: B = W.t(), shards are row blocks of W [N, K].
    w = b.t().contiguous()
    full = ig.invariant_mm(a, w.t())
    assert_bitwise(full, ig.invariant_mm(a, b), "B row-major vs B = W.t()")
    s = N // tp
    for r in range(tp):
        assert_bitwise(ig.invariant_mm(a, w[r * s:(r + 1) * s].t()), full[:, r * s:(r + 1) * s], f"W rows {r}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cpu_accuracy(dtype):
    for shape in [(M, K, N), (64, 1024, 96), (5, 1, 7)]:
        a, b = operands(*shape, dtype, seed=1)
        c = ig.invariant_mm(a, b)
        assert c.dtype == dtype and c.shape == (shape[0], shape[2])
        assert rel_err(c, ig.reference_mm(a, b)) < TOL[dtype], shape


def test_cpu_chunking_does_not_change_bits(monkeypatch):
    """Chunks over rows/columns only bound memory: a tiny budget gives the same bits."""
    a, b = operands(M, K, N, torch.float32)
    full = ig.cpu_mm(a, b)
    import tpdiag.kernels.invariant_gemm_cpu as igc

    monkeypatch.setattr(igc, "_CPU_CHUNK_ELEMS", 3 * K)
    assert_bitwise(ig.cpu_mm(a, b), full, "tiny chunks")


def _splitk_partials(a, b, splits):
    """Each K-chunk through cpu_mm, kept in fp32 (the partials of a split-K GEMM or of a
    row-parallel linear's ranks)."""
    k = a.shape[1]
    bounds = [k * i // splits for i in range(splits + 1)]
    return [ig.cpu_mm(a[:, k0:k1], b[k0:k1], out_dtype=torch.float32) for k0, k1 in zip(bounds, bounds[1:])]


def _splitk_mm(a, b, splits):
    """Split-K with the partials rounded to the input dtype and added in rank order, like a
    row-parallel linear followed by an all-reduce: a different summation order (and, for
    bf16, a different rounding) than one full-K reduction."""
    parts = [p.to(a.dtype) for p in _splitk_partials(a, b, splits)]
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _shape_dependent_mm(a, b):
    # What BLAS heuristics do: small M -> split-K. Rows then depend on the batch size.
    return _splitk_mm(a, b, 3 if a.shape[0] < 32 else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cpu_negative_control_detects_reduction_order(dtype):
    a, b = operands(M, K, N, dtype)
    # The control is accurate (so only the order and rounding of partials differ) ...
    assert rel_err(_splitk_mm(a, b, 3), ig.reference_mm(a, b)) < 2 * TOL[dtype]
    # ... and the very assertion used above catches it.
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise(_splitk_mm(a, b, 3), ig.invariant_mm(a, b), "split-K vs invariant")
    with pytest.raises(AssertionError, match="differ bitwise"):
        check_rows(_shape_dependent_mm, a, b)
    with pytest.raises(AssertionError, match="differ bitwise"):
        # column shards computed with a split-K that depends on N
        check_cols(lambda x, y: _splitk_mm(x, y, 3 if y.shape[1] < N else 1), a, b, 4)


def test_cpu_power_of_two_k_tree_is_split_k_invariant():
    """With K a power of two, each rank's K-chunk is a subtree of cpu_mm's pairwise tree:
    fp32 partials combined pairwise (a tree all-reduce) reproduce the full product bitwise
    (the TBIK property a row-parallel fix can build on). Combined in rank order, or split
    3 ways, they do not."""
    a, b = operands(33, 128, 40, torch.float32)
    full = ig.cpu_mm(a, b)
    p2 = _splitk_partials(a, b, 2)
    assert_bitwise(p2[0] + p2[1], full, "2-way tree")
    p4 = _splitk_partials(a, b, 4)
    assert_bitwise((p4[0] + p4[1]) + (p4[2] + p4[3]), full, "4-way tree")
    with pytest.raises(AssertionError):
        assert_bitwise(((p4[0] + p4[1]) + p4[2]) + p4[3], full, "4-way in rank order")
    p3 = _splitk_partials(a, b, 3)
    with pytest.raises(AssertionError):
        assert_bitwise((p3[0] + p3[1]) + p3[2], full, "3-way split")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cpu_linear_and_addmm(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 64, generator=g).to(dtype)
    w = (torch.randn(40, 64, generator=g) / 8).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    y = ig.invariant_linear(x, w, bias)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert y.shape == (2, 9, 40) and y.dtype == dtype and rel_err(y, ref) < tol
    assert rel_err(ig.invariant_linear(x, w), torch.nn.functional.linear(x.double(), w.double())) < tol
    assert_bitwise(ig.invariant_linear(x[1:, 2:5], w, bias), y[1:, 2:5], "linear rows")
    for tp in (2, 4, 8):
        s = 40 // tp
        for r in range(tp):
            sl = slice(r * s, (r + 1) * s)
            assert_bitwise(ig.invariant_linear(x, w[sl], bias[sl]), y[..., sl], f"linear {tp}-way shard {r}")
    x2 = x.reshape(-1, 64)
    z = ig.invariant_addmm(bias, x2, w.t(), beta=2, alpha=0.5)
    assert rel_err(z, 2 * bias.double() + 0.5 * (x2.double() @ w.double().t())) < tol
    nan_bias = torch.full_like(bias, float("nan"))
    assert not torch.isnan(ig.invariant_addmm(nan_bias, x2, w.t(), beta=0)).any()  # beta=0 ignores bias


def test_config_fp32_precision_defaults():
    """fp32_precision is a fixed per-dtype config field: Hopper's fp32 is the pre-split bf16x6
    kernel (measured on an H200: faster and more accurate than cuBLAS fp32), pre-Hopper and
    the interpreter keep IEEE fp32; it round-trips, and typos are refused."""
    for table in (ig.CUDA_CONFIGS_PRE_HOPPER, ig.INTERPRETER_CONFIGS):
        assert all(c.fp32_precision == "ieee" for c in table.values())
    assert ig.CUDA_CONFIGS[torch.float32].fp32_precision == "bf16x6" and ig.CUDA_CONFIGS[torch.float32].tma
    base = ig.default_config(torch.float32, torch.device("cpu"))
    t3 = dataclasses.replace(base, fp32_precision="tf32x3")
    assert t3.fp32_precision == "tf32x3" and t3 != base
    assert ig.GemmConfig(**dataclasses.asdict(t3)) == t3
    for bad in ("tf32", "TF32x3", "bf16x3", "BF16x6"):
        with pytest.raises(ValueError, match="fp32_precision"):
            dataclasses.replace(base, fp32_precision=bad)


def test_bad_inputs_are_clear():
    a, b = operands(4, 8, 6, torch.float32)
    with pytest.raises(ValueError, match="inner dimensions"):
        ig.invariant_mm(a, b[:5])
    with pytest.raises(TypeError, match="share a dtype"):
        ig.invariant_mm(a, b.double())
    with pytest.raises(TypeError, match="not supported"):
        ig.invariant_mm(a.int(), b.int())
    with pytest.raises(ValueError, match="2-D"):
        ig.invariant_mm(a[None], b)
    assert ig.invariant_mm(a[:0], b).shape == (0, 6)
    assert torch.equal(ig.invariant_mm(a[:, :0], b[:0]), torch.zeros(4, 6))


def test_imports_and_cpu_path_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None          # any "import triton" now raises ImportError
        import torch
        from tpdiag.kernels import invariant_gemm as ig
        a, b = torch.randn(5, 7), torch.randn(7, 3)
        print(float((ig.invariant_mm(a, b).double() - a.double() @ b.double()).abs().max()))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TPDIAG_TRITON_CPU", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout.strip()) < 1e-5


# --------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess: TRITON_INTERPRET=1 before import)
# --------------------------------------------------------------------------------------
_INTERP_SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import torch
    from tpdiag.kernels import invariant_gemm as ig

    IV = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
    M, K, N = 70, 100, 64          # K % BLOCK_K != 0 (masked tail); several tiles per program
    g = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    w = b.t().contiguous()
    res = {}

    def same(x, y):
        return x.shape == y.shape and torch.equal(x.contiguous().view(IV[x.dtype]), y.contiguous().view(IV[y.dtype]))

    def checks(name, mm):
        full = mm(a, b)
        res[name + " rows"] = [same(mm(a[i:j], b), full[i:j])
                               for i, j in [(0, 1), (5, 6), (3, 40), (31, 70), (0, 69), (33, 34)]]
        for tp in (2, 4, 8):
            s = N // tp
            res[f"{name} cols {tp}"] = [same(mm(a, b[:, r * s:(r + 1) * s]), full[:, r * s:(r + 1) * s]) for r in range(tp)]
            fw = mm(a, w.t())
            res[f"{name} wcols {tp}"] = [same(mm(a, w[r * s:(r + 1) * s].t()), fw[:, r * s:(r + 1) * s]) for r in range(tp)]
        res[name + " err"] = ((full.double() - ig.reference_mm(a, b)).norm() / ig.reference_mm(a, b).norm()).item()
        # Column-major A (backward's x.t() @ dy): strided loads / the transposed-A descriptor.
        # Only invariance within the layout is asserted: across layouts the interpreter's
        # numpy matmul (not the kernel) may differ. On the GPU, layouts were bitwise equal.
        a_cm = a.t().contiguous().t()
        full_cm = mm(a_cm, b)
        res[name + " layouts"] = [same(mm(a_cm[3:40], b), full_cm[3:40]), same(mm(a_cm[0:1], b), full_cm[0:1]),
                                  ((full_cm.double() - full.double()).norm() / full.double().norm()).item() < 1e-2]

    base = ig.INTERPRETER_CONFIGS[dtype]
    checks("dispatch", ig.invariant_mm)                   # TPDIAG_TRITON_CPU=1: pointer kernel
    checks("tma", lambda x, y: ig.triton_mm(x, y, config=dataclasses.replace(base, tma=True)))
    # Negative control: BLOCK_K chosen by M (a shape-dependent reduction order), checked on
    # the kernel's fp32 output (the accumulator addmm/linear use): at this tiny K a bf16
    # output would round most last-bit reorderings away.
    small_k = dataclasses.replace(base, block_k=16)
    shape_dep = lambda x, y: ig.triton_mm(x, y, config=small_k if x.shape[0] < 32 else base, out_dtype=torch.float32)
    full = shape_dep(a, b)
    res["negative rows"] = [same(shape_dep(a[i:j], b), full[i:j]) for i, j in [(0, 1), (3, 20), (5, 6)]]
    res["negative same-config"] = same(ig.triton_mm(a, b, config=small_k, out_dtype=torch.float32), full)
    if dtype == torch.float32:
        # tf32x3 through the TMA kernel with the halved epilogue: the field reaches tl.dot
        # (the interpreter runs it as IEEE fp32; the GPU speed/accuracy is measured by
        # python -m benchmarks gemm --sweep), invariant, and the halved store
        # writes the same bits as the full-tile store.
        t3 = dataclasses.replace(base, tma=True, epilogue_subtile=True, fp32_precision="tf32x3")
        f3 = ig.triton_mm(a, b, config=t3)
        res["tf32x3"] = [same(ig.triton_mm(a[3:40], b, config=t3), f3[3:40]),
                         same(ig.triton_mm(a, b[:, 16:32], config=t3), f3[:, 16:32]),
                         same(ig.triton_mm(a, b, config=dataclasses.replace(t3, epilogue_subtile=False)), f3),
                         ((f3.double() - ig.reference_mm(a, b)).norm() / ig.reference_mm(a, b).norm()).item() < 1e-5]
        # The pre-split bf16 pieces (split_gemm.py): the Hopper fp32 default is bf16x6. K=100
        # is not a multiple of 8, so the pieces' padded-K path runs too.
        from tpdiag.kernels import split_gemm as sg

        for prec in ("bf16x6", "bf16x9"):
            sc = dataclasses.replace(base, tma=True, epilogue_subtile=True, fp32_precision=prec)
            checks(prec, lambda x, y, sc=sc: ig.triton_mm(x, y, config=sc))
        # the Triton split kernel (what CUDA runs) gives the torch split's bits
        pieces = tuple(torch.empty(a.shape, dtype=torch.bfloat16) for _ in range(3))
        sg._triton()
        sg._split_kernel[(2,)](a.contiguous().view(torch.int32), *pieces, a.numel(), BLOCK=4096)
        res["split kernel"] = [torch.equal(p.view(torch.int16), q.view(torch.int16))
                               for p, q in zip(pieces, sg.split_bf16_torch(a))]
        s6 = dataclasses.replace(base, tma=True, epilogue_subtile=True, fp32_precision="bf16x6")
        res["bf16x6 != bf16x9"] = not same(ig.triton_mm(a, b, config=s6),
                                           ig.triton_mm(a, b, config=dataclasses.replace(s6, fp32_precision="bf16x9")))
    else:  # other dtypes ignore fp32_precision
        res["tf32x3"] = [same(ig.triton_mm(a, b, config=dataclasses.replace(base, fp32_precision="tf32x3")),
                              ig.triton_mm(a, b, config=base))]
    res["negative control positive"] = same(ig.triton_mm(a[3:20], b, config=base, out_dtype=torch.float32),
                                            ig.triton_mm(a, b, config=base, out_dtype=torch.float32)[3:20])
    print("RESULT " + json.dumps(res))
""")


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def interp(request):
    return request.param, interpreter_result(_INTERP_SCRIPT, request.param)


@pytest.mark.parametrize("kernel", ["dispatch", "tma"])
def test_triton_rows_bitwise(interp, kernel):
    _, res = interp
    assert all(res[f"{kernel} rows"]), res[f"{kernel} rows"]


@pytest.mark.parametrize("kernel", ["dispatch", "tma"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_triton_column_shards_bitwise(interp, kernel, tp):
    _, res = interp
    assert all(res[f"{kernel} cols {tp}"]), res[f"{kernel} cols {tp}"]
    assert all(res[f"{kernel} wcols {tp}"]), res[f"{kernel} wcols {tp}"]


@pytest.mark.parametrize("kernel", ["dispatch", "tma"])
def test_triton_accuracy(interp, kernel):
    dt, res = interp
    assert res[f"{kernel} err"] < {"fp32": 1e-5, "bf16": 1e-2}[dt]


@pytest.mark.parametrize("kernel", ["dispatch", "tma"])
def test_triton_column_major_a(interp, kernel):
    """A column-major A (strided loads; the TMA kernel's transposed-A descriptor) is
    row-invariant and computes the same product."""
    _, res = interp
    assert all(res[f"{kernel} layouts"]), res[f"{kernel} layouts"]


def test_triton_tf32x3_config(interp):
    """fp32: a tf32x3 config runs (TMA kernel, halved epilogue), is invariant and accurate
    under the interpreter; bf16: fp32_precision changes nothing."""
    _, res = interp
    assert all(res["tf32x3"]), res["tf32x3"]


@pytest.mark.parametrize("prec", ["bf16x6", "bf16x9"])
def test_triton_split_bf16_configs(interp, prec):
    """fp32 from pre-split bf16 pieces (the Hopper default): row-, column- and weight-shard
    invariant, as accurate as fp32 (the interpreter's dots are exact fp32 matmuls of the
    pieces); the split kernel gives the torch split's bits; the terms kept change the bits."""
    dt, res = interp
    if dt != "fp32":
        pytest.skip("fp32 operands only")
    assert all(res[f"{prec} rows"]), res[f"{prec} rows"]
    for tp in (2, 4, 8):
        assert all(res[f"{prec} cols {tp}"]) and all(res[f"{prec} wcols {tp}"]), tp
    assert res[f"{prec} err"] < 1e-6, res[f"{prec} err"]
    assert all(res["split kernel"]), res["split kernel"]
    assert res["bf16x6 != bf16x9"]


def test_split_pieces_are_exact():
    """x = x0 + x1 + x2 exactly for every finite fp32 (incl. FLT_MAX, which round-to-nearest
    would overflow), each piece a bf16; inf/NaN stay in x0."""
    from tpdiag.kernels.split_gemm import split_bf16_torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    x[:4] = torch.tensor([3.4028234663852886e38, -3.4028234663852886e38, 1.1754943508222875e-38, -0.0])
    x[4:7] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    p = split_bf16_torch(x)
    assert all(q.dtype == torch.bfloat16 for q in p)
    s = p[0].float() + p[1].float() + p[2].float()
    fin = torch.isfinite(x)
    assert torch.equal(s[fin], x[fin])  # values (the sum of -0.0's pieces is +0.0: same product)
    assert torch.equal(s[4:6], x[4:6]) and torch.isnan(s[6])
    # truncation, not rounding: |x0| <= |x| (no overflow near FLT_MAX)
    assert bool((p[0].float().abs() <= x.abs())[fin].all())


def test_triton_negative_control(interp):
    _, res = interp
    # A BLOCK_K that changes with M breaks the row check on some slice (the check can fail) ...
    assert not all(res["negative rows"]), res["negative rows"]
    # ... and a different BLOCK_K is a different summation order: different bits,
    assert not res["negative same-config"]
    # while the fixed config passes the same check on the fp32 output.
    assert res["negative control positive"]
