"""The reductions over tokens that feed a weight's fp32 carry (grad_carry.py), block by block.

Every one walks the tokens in order in FIXED blocks and adds each block's sum to the carry:
carry = carry + blocksum(block). A block's sum is one call of one shape (so one kernel path,
one order inside it) whatever piece it belongs to; pieces whose token counts are multiples of
the block continue the walk exactly, so micro-batches give the bits of one call over every token.

- Triton path (CUDA, or the interpreter): invariant_gemm.triton_mm with `acc=` - its K walk in
  BLOCK_K steps IS the block walk (K = tokens); the block is the config's BLOCK_K.
- torch path: blocks of `torch_block()` tokens (the last zero-padded: zeros add exact zeros),
  each a [N, T] @ [T, K] fp32 matmul or a [T, D] column sum, added in order.
- embedding rows: index_add_ into the carry, one token after another (CPU: a sequential loop
  over the index; CUDA under deterministic algorithms: index_put_ with accumulate, which sorts
  the indices stably and adds the duplicates in that order onto the destination - token order;
  plausible from torch's implementation, not verified here on a GPU).
"""
from __future__ import annotations

import torch

# Tokens per block on the torch path. CPU: 8 divides the token count of any micro-batch of
# 8-token sequences; one BLAS call per block per weight group is cheap at CPU model sizes.
# CUDA: 64 (the bf16 Triton BLOCK_K), so fewer kernel launches per reduction.
CPU_BLOCK = 8
CUDA_BLOCK = 64


def torch_block(device: torch.device) -> int:
    return CUDA_BLOCK if device.type == "cuda" else CPU_BLOCK


def _block(t: torch.Tensor, i: int, T: int) -> torch.Tensor:
    """Rows [i, i + T) of t [M, C] as a fresh contiguous fp32 [T, C] (zero rows past M)."""
    b = t[i:i + T].float()
    if b.shape[0] < T:
        b = torch.cat([b, b.new_zeros(T - b.shape[0], b.shape[1])])
    return b.contiguous()


def add_mm(carry: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, *, triton: bool = False,
           config=None) -> None:
    """carry [N, K] (fp32, may be a view) += g2 [M, N]^T @ x2 [M, K], the M tokens in order.

    triton: one invariant-GEMM call that starts from the carry (16-bit or fp32 operands, fp32
    accumulator; `config` as the non-carry call would use it, so one piece gives its bits)."""
    if triton:
        from tpdiag.kernels.invariant_gemm import triton_mm

        carry.copy_(triton_mm(g2.t(), x2, acc=carry, config=config))
        return
    T = torch_block(g2.device)
    for i in range(0, g2.shape[0], T):
        carry.add_(torch.mm(_block(g2, i, T).t().contiguous(), _block(x2, i, T)))


def add_colsum(carry: torch.Tensor, terms: torch.Tensor) -> None:
    """carry [C] (fp32) += terms [M, C].sum(0), the M rows in blocks, in order."""
    T = torch_block(terms.device)
    for i in range(0, terms.shape[0], T):
        carry.add_(_block(terms, i, T).sum(0))


def add_rows(carry: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """carry [V, D] (fp32): row index[t] += rows[t] for every token t, in token order."""
    carry.index_add_(0, index, rows.float())


def gemm_block(triton: bool, device: torch.device, dtype: torch.dtype, config=None) -> int:
    """Tokens per block of add_mm on this path (what a piece's token count must be a multiple of)."""
    if triton:
        from tpdiag.kernels.invariant_gemm import default_config

        return (config or default_config(dtype, device)).block_k
    return torch_block(device)


def piece_multiple(device: torch.device) -> int:
    """What every micro-batch's token count must be a multiple of for the carries on `device`
    to continue exactly: every block size a path there may use (torch blocks, Triton BLOCK_K)."""
    import math
    import os

    if device.type == "cuda":
        return CUDA_BLOCK  # bf16/fp16 BLOCK_K 64, fp32 32, torch blocks 64
    if os.environ.get("TPDIAG_TRITON_CPU") == "1":
        from tpdiag.kernels.invariant_gemm_config import INTERPRETER_CONFIGS

        return math.lcm(CPU_BLOCK, *(c.block_k for c in INTERPRETER_CONFIGS.values()))
    return CPU_BLOCK
