"""What the invariant-attention Triton kernels share: the tile config (fixed per dtype, never
per shape), the dot with its precision, and the input layout helpers. Imports Triton at import
time: import this module lazily."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    # defaults: the fastest tiles of sweeps on an H100 and an H200 at B8 S4096 H32 D64 bf16
    # causal (docs/benchmarks.md, "Invariant attention")
    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    kv_m: int = 64      # dk/dv pass: query rows per step
    kv_n: int = 64      # dk/dv pass: keys per program
    kv_warps: int = 4
    kv_stages: int = 3
    q_m: int = 128      # dq pass: query rows per program
    q_n: int = 64       # dq pass: keys per step
    q_warps: int = 4
    q_stages: int = 3
    # 1: the loads inside the loops (K/V in the forward and the dq pass, Q/dO in the dk/dv
    # pass) go through 4-D TMA descriptors where the GPU has TMA (sm_90+) and the tensors are
    # 16-byte aligned; else pointers. The same values reach the same dots: the same bits.
    tma: int = 1
    # 1: one backward pass, dq added through int64 atomics on a per-row fixed-point grid
    # (attention_triton_bwd._backward_fixed); 0: a separate dq pass that recomputes P. Other
    # bits, each invariant.
    dq_fixed: int = 1

    def __post_init__(self):
        # the causal loops split at the diagonal on block boundaries
        if self.fwd_m % self.fwd_n or self.kv_n % self.kv_m or self.q_m % self.q_n:
            raise ValueError(f"AttnConfig {self}: fwd_m, kv_n and q_m must be multiples of fwd_n, kv_m, q_n")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# One fixed config per dtype (never per shape): fp32 tiles are smaller (IEEE fp32 dots).
CONFIGS = {torch.bfloat16: AttnConfig(), torch.float16: AttnConfig(),
           torch.float32: AttnConfig(64, 32, 4, 2, 32, 64, 4, 2, 64, 32, 4, 2)}


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    if PREC == "up":
        # the Triton interpreter (3.9) gets 16-bit tl.dot wrong: upcast there. The products of
        # 16-bit values are exact in fp32, so only the fp32 accumulation order can differ.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


def _prec(t: torch.Tensor) -> str:
    if t.device.type == "cpu" and t.dtype != torch.float32:
        return "up"  # the interpreter
    return "ieee" if t.dtype == torch.float32 else "tf32"  # tf32 is unused for 16-bit dots


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _load_rows(src, b, h, start, stride, n, BR: tl.constexpr, D: tl.constexpr, EVEN: tl.constexpr,
               TMA: tl.constexpr):
    """Rows start .. start + BR of head (b, h), zeros past row n: src is a 4-D TMA descriptor
    (which zero-fills past the end) or a pointer to the head's row 0."""
    if TMA:
        return src.load([b, h, start, 0]).reshape(BR, D)
    else:
        rows = start + tl.arange(0, BR)
        ptr = src + rows[:, None] * stride + tl.arange(0, D)[None, :]
        if EVEN:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=rows[:, None] < n, other=0.0)


def tma_ok(cfg: AttnConfig, *ts: torch.Tensor) -> bool:
    if not cfg.tma or not ts[0].is_cuda or torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    # TMA: the base 16-byte aligned, every stride but the last a multiple of 16 bytes
    return all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
               for t in ts)


def descriptors(tma: bool, rows: int, *ts: torch.Tensor) -> tuple:
    """A [1, 1, rows, D] TMA descriptor per [B, H, N, D] tensor, or the tensors themselves."""
    if not tma:
        return ts
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]]) for t in ts)
