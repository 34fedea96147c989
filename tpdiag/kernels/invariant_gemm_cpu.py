"""invariant-gemm on the CPU: pure torch, no BLAS, invariant by construction; and the float64
reference. (The Triton kernel and the dispatchers are in invariant_gemm.py.)"""
from __future__ import annotations

from typing import Optional

import torch

from tpdiag.kernels.gemm_common import _SUPPORTED, _check

# --------------------------------------------------------------------------------------
# CPU path: pure torch, invariant by construction
# --------------------------------------------------------------------------------------
# Elements of the [rows, K, cols] product block materialised at once (fp32: 32 MiB).
_CPU_CHUNK_ELEMS = 1 << 23


def _tree_sum_k(p: torch.Tensor) -> torch.Tensor:
    """Pairwise-sum p [m, K, n] over dim 1 in a fixed tree that depends only on K.

    Level by level: an odd trailing element is carried up unchanged, the rest are added
    in adjacent pairs (p[2i] + p[2i+1]). Every output element is therefore one fixed
    expression tree of scalar fp32 additions; torch's elementwise add rounds each of them
    exactly once (IEEE round-to-nearest) whatever the tensor's shape, strides or
    vectorisation, so the bits cannot depend on m, n or on the position in the block.
    """
    while p.shape[1] > 1:
        k = p.shape[1]
        even = k - (k % 2)
        s = p[:, 0:even:2] + p[:, 1:even:2]
        if k % 2:
            s = torch.cat([s, p[:, even:]], dim=1)
        p = s
    return p[:, 0]


def cpu_mm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """C = A @ B on the CPU without BLAS, row- and column-invariant by construction.

    For each output element: the K products a[m,k] * b[k,n] are formed in fp32 (exact for
    bf16/fp16 inputs: 8+8 or 11+11 significant bits fit in fp32's 24; one IEEE rounding
    for fp32 inputs) and summed by ``_tree_sum_k``'s pairwise tree, which depends only on
    K. Only elementwise multiplies and adds are used -- no matmul, so no BLAS kernel whose
    blocking or split-K depends on the shape, and no fused multiply-add whose use could
    differ between a vectorised body and a scalar tail. Chunking over rows and columns only
    bounds memory: an element's expression is the same in every chunk. float64 inputs are
    summed in float64 the same way. Cost is O(M*N*K) elementwise work (far slower than
    BLAS): meant for the small models tpdiag runs on CPU.
    """
    _check(a, b, "cpu_mm")
    if a.dtype not in _SUPPORTED + (torch.float64,):
        raise TypeError(f"cpu_mm: dtype {a.dtype} not supported; use float32, bfloat16, float16 or float64")
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or a.dtype
    acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    af = a.to(acc_dtype)
    bf = b.to(acc_dtype)
    # Column chunk first (so a wide N still fits), then as many rows as the budget allows.
    cols = max(1, min(N, _CPU_CHUNK_ELEMS // K))
    rows = max(1, min(M, _CPU_CHUNK_ELEMS // (K * cols)))
    for n0 in range(0, N, cols):
        bc = bf[:, n0:n0 + cols].unsqueeze(0)                          # [1, K, n]
        for m0 in range(0, M, rows):
            p = af[m0:m0 + rows].unsqueeze(2) * bc                     # [m, K, n] products
            out[m0:m0 + rows, n0:n0 + cols] = _tree_sum_k(p)           # one rounding to out_dtype
    return out


def reference_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 reference (accuracy checks only; returns float64)."""
    _check(a, b, "reference_mm")
    return a.double() @ b.double()
