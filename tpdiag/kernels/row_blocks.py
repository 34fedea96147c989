"""A CPU GEMM whose bits for a row do not depend on how many rows share the call.

Why: CPU BLAS picks its kernel by shape. MKL's fp32 GEMM, for one, takes another path below 4
rows (a decode step's M = batch rows) than above (a prefill's M = batch x sequence rows), and the
two sum the same dot products in other orders (about 1 ULP apart). A micro-batch or a decode step
then gives a token other bits than the full batch or the prefill gave it: a batch-variant kernel.

How: the rows are cut into blocks of ROWS (the last zero-padded) and every BLAS call is one block,
[ROWS, K] @ [K, N] - one shape for every M, so one kernel path. What is left to hold is that a
row's bits do not depend on its place in the block or on the other rows' values: true of a BLAS
kernel of one shape (a row is its own dot products; tests/test_decode_numerics.py checks it on
the machine it runs on, and that M=1 without the blocks differs). The Triton analogue is
invariant-gemm's fixed BLOCK_M (invariant_gemm.py). Used on the CPU by the linear fixes'
group GEMMs (tpdiag/kernels/grouped_linear.py); `reference_mm` is the float64 reference.
"""
from __future__ import annotations

import torch

# Rows per BLAS call: >= 4 (MKL's small-M path is below that), a power of two; a decode step of
# a few sequences pays up to ROWS / M times the work of its GEMMs, still small on a CPU model.
ROWS = 16


def row_blocked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ b [K, N] with every BLAS call of shape [ROWS, K] @ [K, N] (b as given)."""
    lead, K = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, K)
    M = a2.shape[0]
    pad = (-M) % ROWS
    if pad:
        a2 = torch.cat([a2, a2.new_zeros(pad, K)])
    a2 = a2.contiguous()
    out = torch.cat([torch.matmul(a2[i:i + ROWS], b) for i in range(0, a2.shape[0], ROWS)])
    from tpdiag.kernels.shaped import shaped

    # no view of the temporary (a Function's output the user's model may scale in place: shaped.py)
    return shaped(out[:M], *lead, b.shape[-1])


def reference_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 reference (accuracy checks only)."""
    return a.double() @ b.double()
