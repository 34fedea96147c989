"""fp32 invariant GEMM on bf16 tensor cores: operands split into three bf16 pieces.

Why: the IEEE fp32 kernel runs on the FMA units and reached 84% of cuBLAS fp32 on an H200
(docs/benchmarks.md). Every fp32 x has a 24-bit significand; cutting it into three 8-bit
pieces x = x0 + x1 + x2 (each exactly a bf16) turns one fp32 product into at most nine bf16
products, each exact in the fp32 accumulator of a tensor-core dot. "bf16x9" keeps all nine
(what cuBLAS's fp32 emulation on Blackwell does); "bf16x6" drops the three smallest
(x1*y2 and x2*y1 at most ~2**-24 of the product each, x2*y2 ~2**-32): about 2**-23 relative
per product, the size of the fp32 rounding that every step of a K-long sum adds anyway.

Invariance is the IEEE kernel's: fixed tiles per dtype, no split-K, the K loop walked upwards
into one fp32 accumulator, and within a K step the terms added in one fixed order (smallest
first). The split is elementwise, so a row's or column's pieces do not depend on its shard.

Split by truncation (bit masks), not rounding: x0 = x with its low 16 bits cleared cannot
overflow to inf near FLT_MAX, and each remainder is exact in fp32. Non-finite x keep their
value in x0 and zeros in x1, x2, so inf/NaN propagate as in an fp32 product. Limitation: a
third piece below 2**-133 (|x| < ~2**-110) loses bits as a bf16 subnormal.

Layout: `_split_kernel` (Triton, elementwise split), `_split_mm_tma_kernel` (Triton,
persistent TMA GEMM over the pieces), `split_bf16` / `split_mm` (torch wrappers),
`split_bf16_torch` (the split in plain torch: the reference and the CPU path).
"""
from __future__ import annotations

import functools

import torch

from tpdiag.kernels import gemm_common
from tpdiag.kernels.gemm_common import _padded_empty, _tma_ok

triton = None
tl = None

SPLIT_PRECISIONS = {"bf16x6": 6, "bf16x9": 9}
_HI = -65536  # 0xFFFF0000 as int32: sign, exponent and the top 7 stored significand bits


# --------------------------------------------------------------------------------------
# Triton kernels (wrapped with triton.jit by _triton())
# --------------------------------------------------------------------------------------
def _split_kernel(x_ptr, p0_ptr, p1_ptr, p2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(x_ptr + offs, mask=mask, other=0)
    x = bits.to(tl.float32, bitcast=True)
    x0 = (bits & -65536).to(tl.float32, bitcast=True)
    r1 = x - x0                                   # exact: the low 16 significand bits
    x1 = (r1.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    r2 = r1 - x1                                  # exact, at most 8 significant bits
    fin = tl.abs(x) <= 3.4028234663852886e38
    x1 = tl.where(fin, x1, 0.0)
    r2 = tl.where(fin, r2, 0.0)
    tl.store(p0_ptr + offs, x0.to(tl.bfloat16), mask=mask)
    tl.store(p1_ptr + offs, x1.to(tl.bfloat16), mask=mask)
    tl.store(p2_ptr + offs, r2.to(tl.bfloat16), mask=mask)


def _split_mm_tma_kernel(
    a0_desc, a1_desc, a2_desc, b0_desc, b1_desc, b2_desc, c_desc, acc_ptr, M, N, K,
    stride_accm, stride_accn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, TERMS: tl.constexpr,
    FLATTEN: tl.constexpr, UPCAST: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    PROMOTE: tl.constexpr, HAS_ACC: tl.constexpr,
):
    """Persistent C = A @ B from pieces: A pieces [M, K] row-major, B pieces held as B^T
    [N, K] row-major (a linear's weight layout). TMA zero-fills past M, N and K."""
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    tile_id_c = start_pid - NUM_SMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if HAS_ACC:  # an earlier call's fp32 accumulator (invariant_gemm.triton_mm's acc)
            acc = _load_acc(acc_ptr, off_m, off_n, M, N, stride_accm, stride_accn, BLOCK_M, BLOCK_N)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            x0 = a0_desc.load([off_m, off_k])
            x1 = a1_desc.load([off_m, off_k])
            x2 = a2_desc.load([off_m, off_k])
            y0 = b0_desc.load([off_n, off_k]).T
            y1 = b1_desc.load([off_n, off_k]).T
            y2 = b2_desc.load([off_n, off_k]).T
            if UPCAST:  # interpreter only: its dot mis-reads bf16 (exact in fp32 anyway)
                x0, x1, x2 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32)
                y0, y1, y2 = y0.to(tl.float32), y1.to(tl.float32), y2.to(tl.float32)
            # smallest terms first, one fixed order for every tile. PROMOTE: the K step's
            # terms go into a fresh accumulator, added to the running sum on the FMA units
            # (tensor-core accumulation may keep fewer bits than fp32 across many steps)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) if PROMOTE else acc
            if TERMS == 9:
                part = tl.dot(x2, y2, part)
                part = tl.dot(x1, y2, part)
                part = tl.dot(x2, y1, part)
            part = tl.dot(x0, y2, part)
            part = tl.dot(x2, y0, part)
            part = tl.dot(x1, y1, part)
            part = tl.dot(x0, y1, part)
            part = tl.dot(x1, y0, part)
            part = tl.dot(x0, y0, part)
            acc = acc + part if PROMOTE else part

        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        _store_tile(c_desc, acc, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


@functools.lru_cache(maxsize=1)
def _triton():
    global triton, tl
    triton = gemm_common.import_triton()  # the interpreter switch, and the shared _tile_coords / _store_tile
    tl = triton.language
    g = globals()
    g["_tile_coords"], g["_store_tile"] = gemm_common._tile_coords, gemm_common._store_tile
    g["_load_acc"] = gemm_common._load_acc
    g["_split_kernel"] = triton.jit(_split_kernel)
    # M and N never specialised: one compiled kernel (the same dots) for every shape
    g["_split_mm_tma_kernel"] = triton.jit(_split_mm_tma_kernel, do_not_specialize=["M", "N"])
    return triton


# --------------------------------------------------------------------------------------
# torch wrappers
# --------------------------------------------------------------------------------------
def split_bf16_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (fp32) = x0 + x1 + x2 exactly, each a bf16 tensor of x's shape (contiguous)."""
    x = x.contiguous()
    x0 = (x.view(torch.int32) & _HI).view(torch.float32)
    r1 = x - x0
    x1 = (r1.view(torch.int32) & _HI).view(torch.float32)
    r2 = r1 - x1
    fin = torch.isfinite(x)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    return (x0.to(torch.bfloat16), torch.where(fin, x1, zero).to(torch.bfloat16),
            torch.where(fin, r2, zero).to(torch.bfloat16))


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split, one Triton pass on CUDA (same bits as split_bf16_torch)."""
    if x.device.type != "cuda":
        return split_bf16_torch(x)
    _triton()
    x = x.contiguous()
    parts = tuple(torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) for _ in range(3))
    n = x.numel()
    if n:
        _split_kernel[(triton.cdiv(n, 4096),)](x.view(torch.int32), *parts, n, BLOCK=4096, num_warps=8)
    return parts


def split_mm(a: torch.Tensor, b: torch.Tensor, cfg, out_dtype: torch.dtype, num_sms: int,
             upcast: bool = False, promote: bool = True, acc=None) -> torch.Tensor:
    """C = A @ B for fp32 A [M, K], B [K, N] with cfg.fp32_precision in SPLIT_PRECISIONS
    (acc: an fp32 [M, N] accumulator to start from, as invariant_gemm.triton_mm's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _triton()
    M, K = a.shape
    N = b.shape[1]
    pa = split_bf16(_k_aligned(a))
    pb = split_bf16(_k_aligned(b.t()))  # B^T [N, K]: K contiguous, as TMA wants for B
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    ct = c if _tma_ok(c) else _padded_empty(M, N, out_dtype, a.device)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    da = [TensorDescriptor(p, [M, K], list(p.stride()), [bm, bk]) for p in pa]
    db = [TensorDescriptor(p, [N, K], list(p.stride()), [bn, bk]) for p in pb]
    subtile = cfg.epilogue_subtile or c.element_size() > 2
    dc = TensorDescriptor(ct, list(ct.shape), list(ct.stride()), [bm, bn // 2 if subtile else bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    _split_mm_tma_kernel[(min(num_sms, tiles),)](
        *da, *db, dc, acc if acc is not None else c, M, N, K,
        (acc if acc is not None else c).stride(0), (acc if acc is not None else c).stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        NUM_SMS=num_sms, TERMS=SPLIT_PRECISIONS[cfg.fp32_precision], FLATTEN=cfg.flatten,
        UPCAST=upcast, EPILOGUE_SUBTILE=subtile, PROMOTE=promote,
        HAS_ACC=acc is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if ct is not c:
        c.copy_(ct)
    return c


def _k_aligned(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] with K contiguous and a 16-byte aligned row stride for the bf16 pieces
    (K padded with zeros to a multiple of 8; zeros add exact zeros to every dot)."""
    R, K = x.shape
    if K % 8 == 0:
        return x.contiguous()
    buf = torch.zeros((R, -(-K // 8) * 8), dtype=x.dtype, device=x.device)
    buf[:, :K] = x
    return buf
