"""What the invariant GEMM files share (invariant_gemm.py, invariant_gemm_cpu.py, split_gemm.py):
the Triton importer, the persistent kernels' tile helpers, operand checks and TMA layout rules.

The tile helpers are plain functions wrapped with ``triton.jit`` by ``import_triton()``; a
kernel module binds the wrapped helpers into its own globals, where Triton resolves them.
"""
from __future__ import annotations

import functools
import os

import torch

# Bound by import_triton(): the helpers below resolve ``tl`` from this module's globals.
triton = None
tl = None

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------
# Triton helpers shared by the persistent kernels (wrapped with triton.jit by import_triton())
# --------------------------------------------------------------------------------------
def _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    # Grouped ("super-grouping") tile order: GROUP_M tile-rows share B tiles in L2.
    # Which program computes a tile, and when, never changes what the tile computes.
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


def _store_tile(c_desc, acc, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EPILOGUE_SUBTILE: tl.constexpr):
    if EPILOGUE_SUBTILE:
        # Store in two [BLOCK_M, BLOCK_N // 2] halves: halves the shared-memory staging
        # (needed for an fp32 output of a bf16 product). Same values, same bits.
        acc3 = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(acc3)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc0.to(c_desc.dtype))
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], acc1.to(c_desc.dtype))
    else:
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def _load_ab(a_desc, b_desc, off_m, off_n, off_k, A_T: tl.constexpr, B_T: tl.constexpr,
             UPCAST: tl.constexpr):
    """One K step's A and B tiles through their TMA descriptors (A_T/B_T: stored transposed)."""
    if A_T:
        a = a_desc.load([off_k, off_m]).T
    else:
        a = a_desc.load([off_m, off_k])
    if B_T:
        b = b_desc.load([off_n, off_k]).T
    else:
        b = b_desc.load([off_k, off_n])
    if UPCAST:  # interpreter only: its dot mis-reads bf16 (see invariant_gemm.triton_mm)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


def _load_acc(acc_ptr, off_m, off_n, M, N, stride_m, stride_n, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """A tile's fp32 accumulator from an earlier call (grad accumulation's carry): the K walk
    goes on from it; out-of-range rows/columns read 0 (their store is clipped)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    return tl.load(acc_ptr + rm[:, None] * stride_m + rn[None, :] * stride_n, mask=mask, other=0.0)


_JIT_FUNCTIONS = ("_tile_coords", "_store_tile", "_load_ab", "_load_acc")


@functools.lru_cache(maxsize=None)
def import_triton():
    """Import Triton once (TPDIAG_TRITON_CPU=1: under the interpreter) and wrap the helpers above."""
    global triton, tl
    if os.environ.get("TPDIAG_TRITON_CPU") == "1":
        import sys

        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "TPDIAG_TRITON_CPU=1 needs the Triton interpreter, but triton was already "
                "imported without TRITON_INTERPRET=1; set TRITON_INTERPRET=1 before importing triton")
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton as _triton_mod
        import triton.language as _tl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("invariant-gemm's Triton path needs triton (pip install 'tpdiag[triton]'); "
                           "the CPU path (cpu_mm) works without it") from e
    triton, tl = _triton_mod, _tl
    from tpdiag.kernels.interpreter_patch import lighten

    lighten()  # the interpreter's per-helper re-patching skipped (interpreter_patch.py)
    g = globals()
    for name in _JIT_FUNCTIONS:
        fn = g[name]
        fn = getattr(fn, "fn", fn)  # idempotent if already wrapped
        g[name] = triton.jit(fn)
    return triton


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{name}: expected 2-D A [M, K] and B [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{name}: inner dimensions differ: A {tuple(a.shape)} @ B {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name}: A and B must share a dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{name}: A and B are on different devices ({a.device}, {b.device})")


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base, one unit stride and 16-byte aligned other stride."""
    es = t.element_size()
    if t.data_ptr() % 16:
        return False
    s0, s1 = t.stride()
    if s1 == 1 and (s0 * es) % 16 == 0:
        return True
    if s0 == 1 and (s1 * es) % 16 == 0 and t.shape[1] > 1:
        return True
    return False


def _padded_empty(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised [rows, cols] view whose row stride is a multiple of 16 bytes."""
    pad = 16 // torch.empty((), dtype=dtype).element_size()
    ld = -(-max(cols, 1) // pad) * pad
    return torch.empty((rows, ld), dtype=dtype, device=device)[:, :cols]
