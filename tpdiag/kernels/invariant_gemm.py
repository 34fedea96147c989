"""invariant-gemm: a shape- and batch-invariant GEMM (the ``invariant-gemm`` fix).

Why: cuBLAS and CPU BLAS pick their tiling, split-K and kernel by shape. A column-parallel
linear at TP=N multiplies by a weight with N/TP columns, and a micro-batch has fewer rows
than the full batch, so the same dot product can be summed in a different order than at
TP=1 although no communication is involved (BACKGROUND.md, cause 2). This module computes
``C = A @ B`` so that the bits of ``C[m, n]`` depend only on ``A[m, :]``, ``B[:, n]`` and
``K`` -- never on ``M``, ``N``, the row's position in the batch or the column's position in
the shard:

* ``triton_mm``: a persistent Triton kernel with fixed tiles per dtype (and device, never
  per shape), no split-K, the K loop always walked from 0 upwards in BLOCK_K steps into an
  fp32 accumulator; fp32 operands multiplied in IEEE fp32 on the FMA units (shipped), or,
  per config (``GemmConfig.fp32_precision="tf32x3"``), with the 3xTF32 split product on
  tensor cores. Either is one fixed per-dtype choice, so either is invariant.
* ``cpu_mm``: pure torch on the CPU, no BLAS: fp32 products and a fixed pairwise tree over
  K, built only from elementwise multiplies and adds (each output element is one scalar
  expression whose shape does not depend on M or N).
* ``reference_mm``: float64 reference.
* ``invariant_mm`` / ``invariant_addmm`` / ``invariant_linear``: the dispatchers the fix
  installs.

Triton is imported lazily (``_triton()``), so this module imports, and the CPU path runs,
without Triton. The kernels are written as plain functions at the top of the file (their
annotations stay strings via ``from __future__ import annotations``) and are wrapped with
``triton.jit`` on first use. ``TPDIAG_TRITON_CPU=1`` routes CPU tensors through the Triton
interpreter (``TRITON_INTERPRET=1`` is then set before Triton is imported).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

from tpdiag.kernels import alloc, gemm_common
from tpdiag.kernels.gemm_common import _SUPPORTED, _check, _interpreting, _padded_empty, _tma_ok, import_triton

# Bound by _triton(): the kernels below resolve ``tl`` and the shared tile helpers
# (gemm_common._tile_coords / _store_tile / _load_ab) from this module's globals when Triton compiles
# (or interprets) them.
triton = None
tl = None
_tile_coords = None
_store_tile = None
_load_ab = None
_load_acc = None


# --------------------------------------------------------------------------------------
# Triton kernels (wrapped with triton.jit by _triton())
# --------------------------------------------------------------------------------------
def _invariant_mm_kernel(
    a_ptr, b_ptr, c_ptr, acc_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_accm, stride_accn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr,
    HAS_ACC: tl.constexpr,
):
    """Persistent C = A @ B with pointer loads (any strides, any alignment).

    Each program walks tiles start_pid, start_pid + NUM_SMS, ...; every tile accumulates
    K in BLOCK_K steps, always in the same order, into an fp32 accumulator. Out-of-range
    rows/columns load a valid row/column (index 0) and are masked on the store, so a
    row's or column's result never depends on what else shares its tile.
    """
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    offs_k_base = tl.arange(0, BLOCK_K)
    # A separate counter for the epilogue (the Triton tutorial's work-around for
    # pipelining a value used in both prologue and epilogue).
    tile_id_c = start_pid - NUM_SMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_am = tl.where(offs_am < M, offs_am, 0)
        offs_bn = tl.where(offs_bn < N, offs_bn, 0)
        offs_am = tl.max_contiguous(tl.multiple_of(offs_am, BLOCK_M), BLOCK_M)
        offs_bn = tl.max_contiguous(tl.multiple_of(offs_bn, BLOCK_N), BLOCK_N)

        if HAS_ACC:
            # continue a walk over K that an earlier call began (grad accumulation's fp32
            # carry): the rows/columns were clamped above, so every load is in range
            acc = tl.load(acc_ptr + offs_am[:, None] * stride_accm + offs_bn[None, :] * stride_accn)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            offs_k = ki * BLOCK_K + offs_k_base
            a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
            b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                # Zero padding past K: adds exact zeros, same for every shape with this K.
                a = tl.load(a_ptrs, mask=offs_k_base[None, :] < K - ki * BLOCK_K, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k_base[:, None] < K - ki * BLOCK_K, other=0.0)
            if UPCAST:  # interpreter only: its dot mis-reads bf16 (see triton_mm)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _invariant_mm_tma_kernel(
    a_desc, b_desc, c_desc, acc_ptr, M, N, K, stride_accm, stride_accn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, HAS_ACC: tl.constexpr,
):
    """Persistent C = A @ B with TMA tensor descriptors (Hopper+; same tiles and K order).

    A_T: the descriptor holds A^T ([K, M], A column-major); B_T: it holds B^T ([N, K], e.g.
    a linear's weight). TMA zero-fills out-of-range rows/columns/K and clips the store.
    """
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    tile_id_c = start_pid - NUM_SMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if HAS_ACC:
            acc = _load_acc(acc_ptr, off_m, off_n, M, N, stride_accm, stride_accn, BLOCK_M, BLOCK_N)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a, b = _load_ab(a_desc, b_desc, off_m, off_n, ki * BLOCK_K, A_T, B_T, UPCAST)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        _store_tile(c_desc, acc, pid_m, pid_n, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


_JIT_FUNCTIONS = ("_invariant_mm_kernel", "_invariant_mm_tma_kernel")


@functools.lru_cache(maxsize=None)
def _triton():
    """Import Triton once (gemm_common's importer) and wrap the kernels above with ``triton.jit``."""
    global triton, tl, _tile_coords, _store_tile, _load_ab, _load_acc
    triton = import_triton()
    tl = triton.language
    # The kernels call the shared tile helpers through this module's globals.
    _tile_coords, _store_tile, _load_ab = gemm_common._tile_coords, gemm_common._store_tile, gemm_common._load_ab
    _load_acc = gemm_common._load_acc
    g = globals()
    for name in _JIT_FUNCTIONS:
        fn = g[name]
        fn = getattr(fn, "fn", fn)  # idempotent if already wrapped
        # M and N are never specialised (value 1, divisibility): the compiled kernel,
        # hence every dot instruction, is the same for every M and N.
        g[name] = triton.jit(fn, do_not_specialize=["M", "N"])
    from tpdiag.kernels.jit_keys import settle

    settle({name: g[name] for name in _JIT_FUNCTIONS})  # one disk key whichever launches first
    return triton


# Tile configurations (fixed per device kind and dtype): invariant_gemm_config.py
from tpdiag.kernels.invariant_gemm_config import (  # noqa: E402,F401  (re-exported)
    _major, CUDA_CONFIGS, CUDA_CONFIGS_PRE_HOPPER, FP32_PRECISIONS, INTERPRETER_CONFIGS, GemmConfig,
    default_config)

_INTERPRETER_NUM_SMS = 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(index: int) -> int:
    # the persistent kernel's programs: every SM but those held for a collective running beside it
    return max(1, _sm_count(index) - _RESERVED_SMS[0])


_RESERVED_SMS = [0]


@contextlib.contextmanager
def sms_left_free(n: int):
    """Persistent GEMMs in the block leave `n` SMs free (for a collective on another stream).
    Which program computes a tile never changes what it computes: the same bits."""
    prev = _RESERVED_SMS[0]
    _RESERVED_SMS[0] = n
    try:
        yield
    finally:
        _RESERVED_SMS[0] = prev


# M * N * K below which a 16-bit GEMM skips TMA (2^32: ~9 GFLOP, ~15 us of an H100's tensor cores,
# less than the TMA launch's extra host time)
TMA_MIN_WORK = 1 << 32


# --------------------------------------------------------------------------------------
# Triton wrapper
# --------------------------------------------------------------------------------------
def _tma_operand(t: torch.Tensor):
    """Return (2-D tensor with last stride 1, transposed?) for a descriptor, copying into a
    16-byte aligned padded buffer when the layout does not allow TMA. A copy moves bits
    only, so the result is the same whether or not it was needed."""
    if not _tma_ok(t):
        buf = _padded_empty(t.shape[0], t.shape[1], t.dtype, t.device)
        buf.copy_(t)
        t = buf
    if t.stride(1) == 1:
        return t, False
    return t.t(), True


def triton_mm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: Optional[torch.dtype] = None,
              config: Optional[GemmConfig] = None, acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C = A @ B with the persistent invariant Triton kernel.

    a: [M, K], b: [K, N], any strides, fp32 / bf16 / fp16 (same dtype), CUDA tensors, or
    CPU tensors under ``TRITON_INTERPRET=1``. Returns [M, N] in ``out_dtype`` (default: the
    input dtype; fp32 returns the unrounded accumulator, used by addmm/linear epilogues).
    ``config`` overrides the fixed per-dtype tiles (benchmarks, tests); a different config
    gives different (still invariant) bits.

    ``acc``: an fp32 [M, N] accumulator to start from instead of zeros (the result is fp32, a
    new tensor): the K walk goes on where an earlier call left it, so calls over consecutive K
    ranges whose lengths (all but the last) are multiples of the config's BLOCK_K give the bits
    of one call over the whole K (grad accumulation over micro-batches: K = tokens).
    acc of zeros gives the same bits as no acc (0 + x = x), rounded later by the caller.
    """
    _check(a, b, "triton_mm")
    if a.dtype not in _SUPPORTED:
        raise TypeError(f"triton_mm: dtype {a.dtype} not supported; use float32, bfloat16 or float16")
    _triton()
    M, K = a.shape
    N = b.shape[1]
    if acc is not None:
        if acc.dtype != torch.float32 or tuple(acc.shape) != (M, N) or acc.device != a.device:
            raise ValueError(f"triton_mm: acc must be float32 [{M}, {N}] on {a.device}, got "
                             f"{acc.dtype} {tuple(acc.shape)} on {acc.device}")
        if out_dtype not in (None, torch.float32):
            raise ValueError("triton_mm: with acc the result is the float32 accumulator")
        out_dtype = torch.float32
    out_dtype = out_dtype or a.dtype
    c = alloc.empty((M, N), dtype=out_dtype, device=a.device)  # every tile stored
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.copy_(acc) if acc is not None else c.zero_()
    if a.device.type != "cuda" and out_dtype == torch.bfloat16:
        # The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest even.
        # Keep the kernel's fp32 result and round it in torch (round-to-nearest-even).
        return triton_mm(a, b, out_dtype=torch.float32, config=config).to(torch.bfloat16)
    cfg = config or default_config(a.dtype, a.device, K)
    if a.device.type == "cuda":
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        num_sms = _num_sms(index)
        # Small problems take the pointer kernel: the same tiles, K order and dot instructions,
        # hence the same bits (`benchmarks gemm` checks TMA == pointer), but ~100 us less host
        # time per call on an H100 (three tensor-map encodes per TMA launch) - a decode step's
        # GEMMs are all host time. Large ones keep TMA (pointer loads: 77% of cuBLAS).
        use_tma = cfg.tma and _major(index) >= 9 and (config is not None or M * N * K >= TMA_MIN_WORK)
    else:
        if not _interpreting():
            raise RuntimeError("triton_mm on CPU tensors needs the Triton interpreter "
                               "(TRITON_INTERPRET=1 or TPDIAG_TRITON_CPU=1 before triton is imported)")
        num_sms = _INTERPRETER_NUM_SMS
        use_tma = cfg.tma
    if a.dtype == torch.float32 and cfg.fp32_precision in ("bf16x6", "bf16x9"):
        from tpdiag.kernels.split_gemm import split_mm

        return split_mm(a, b, cfg, out_dtype, num_sms, upcast=a.device.type != "cuda", acc=acc)
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    grid = (min(num_sms, num_tiles),)
    # fp32 operands: the config's fixed fp32_precision ("ieee" FMA or "tf32x3"; never plain
    # TF32, which is not fp32-class). The interpreter ignores it (its dot is a numpy fp32
    # matmul). The flag has no effect on bf16/fp16 operands, whose products are exact in fp32.
    precision = cfg.fp32_precision if a.dtype == torch.float32 else "tf32"
    # The interpreter's tl.dot hands bf16 (stored as raw 16-bit integers in numpy) to
    # np.matmul as integers; upcast to fp32 first, exact for bf16 (8-bit significands, so
    # each product is exact in fp32) and the same fp32 accumulation.
    upcast = a.device.type != "cuda" and a.dtype == torch.bfloat16
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  NUM_SMS=num_sms, DOT_PRECISION=precision, FLATTEN=cfg.flatten, UPCAST=upcast,
                  HAS_ACC=acc is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    acc_t = acc if acc is not None else c  # not read without HAS_ACC
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        at, a_t = _tma_operand(a)
        bt, b_t = _tma_operand(b)
        # N * elsize not 16-byte aligned: the kernel writes into a padded buffer.
        ct = c if _tma_ok(c) else _padded_empty(M, N, out_dtype, a.device)
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        a_desc = TensorDescriptor(at, list(at.shape), list(at.stride()), [bk, bm] if a_t else [bm, bk])
        b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [bn, bk] if b_t else [bk, bn])
        # A wider output (fp32 accumulator out of a bf16/fp16 product, for addmm/linear
        # epilogues) is staged in two halves so the tile still fits in shared memory; a
        # config may ask for that always (same bits either way).
        subtile = c.element_size() > a.element_size() or cfg.epilogue_subtile
        c_desc = TensorDescriptor(ct, list(ct.shape), list(ct.stride()), [bm, bn // 2 if subtile else bn])
        _invariant_mm_tma_kernel[grid](a_desc, b_desc, c_desc, acc_t, M, N, K, acc_t.stride(0),
                                       acc_t.stride(1), A_T=a_t, B_T=b_t,
                                       WARP_SPECIALIZE=cfg.warp_specialize, EPILOGUE_SUBTILE=subtile,
                                       **common)
        if ct is not c:
            c.copy_(ct)
    else:
        _invariant_mm_kernel[grid](
            a, b, c, acc_t, M, N, K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            acc_t.stride(0), acc_t.stride(1), EVEN_K=(K % cfg.block_k == 0), **common)
    return c


# CPU path (no BLAS, invariant by construction) and the float64 reference live beside
# this file: tpdiag/kernels/invariant_gemm_cpu.py.
from tpdiag.kernels.invariant_gemm_cpu import cpu_mm, reference_mm  # noqa: E402,F401


# --------------------------------------------------------------------------------------
# Dispatchers (what the invariant-gemm fix installs)
# --------------------------------------------------------------------------------------
def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    if a.device.type == "cuda":
        return triton_mm(a, b, out_dtype=out_dtype)
    if a.device.type == "cpu":
        if os.environ.get("TPDIAG_TRITON_CPU") == "1":
            return triton_mm(a, b, out_dtype=out_dtype)
        return cpu_mm(a, b, out_dtype=out_dtype)
    raise ValueError(f"invariant_mm: device {a.device} not supported; use cuda or cpu")


def invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A @ B, batch- and column-shard-invariant: CUDA -> triton_mm, CPU -> cpu_mm
    (or the Triton interpreter when TPDIAG_TRITON_CPU=1)."""
    _check(a, b, "invariant_mm")
    return _mm(a, b, None)


def invariant_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """beta * bias + alpha * (A @ B), like torch.addmm: the product stays in fp32 and the
    epilogue (elementwise, so invariant) rounds once to the input dtype. As in torch,
    beta == 0 ignores bias (NaN/inf in it do not propagate)."""
    _check(a, b, "invariant_addmm")
    acc = _mm(a, b, torch.float32 if a.dtype != torch.float64 else torch.float64)
    if alpha != 1:
        acc = acc * alpha
    if beta != 0:
        bias_f = bias.to(acc.dtype)
        acc = acc + (bias_f if beta == 1 else bias_f * beta)
    return acc.to(a.dtype)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the invariant GEMM: x [..., K], weight [N, K], bias [N].

    The leading dims are flattened into rows (a view when x allows it; a copy moves bits
    only), so a token's output does not depend on how many tokens share the batch."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "do not match (expected x [..., K], weight [N, K])")
    x2 = x.reshape(-1, x.shape[-1])
    if bias is None:
        out = invariant_mm(x2, weight.t())
    else:
        out = invariant_addmm(bias, x2, weight.t())
    return out.reshape(*x.shape[:-1], weight.shape[0])


__all__ = [
    "GemmConfig", "FP32_PRECISIONS", "CUDA_CONFIGS", "default_config", "triton_mm", "cpu_mm", "reference_mm",
    "invariant_mm", "invariant_addmm", "invariant_linear",
]
