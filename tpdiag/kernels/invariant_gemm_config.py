"""invariant-gemm's tile configurations: fixed per (device kind, dtype); may depend on K,
never on M or N - a config that changed with the shape would change the bits with it."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False        # TMA descriptors (Hopper+); same tiles and K order either way
    flatten: bool = False    # tl.range(flatten=...) of the persistent tile loop
    warp_specialize: bool = False  # tl.range(warp_specialize=...), TMA kernel only
    epilogue_subtile: bool = False  # TMA kernel: store C in two halves (less shared memory)
    # fp32 operands only: "ieee" (FMA units), "tf32x3" (3xTF32 split product on tensor
    # cores, ~fp32 accuracy) or "bf16x6"/"bf16x9" (pre-split bf16 pieces, split_gemm.py).
    # Fixed per dtype like the tiles; other dtypes ignore it.
    fp32_precision: str = "ieee"

    def __post_init__(self):
        if self.fp32_precision not in FP32_PRECISIONS:
            raise ValueError(f"GemmConfig.fp32_precision must be one of {FP32_PRECISIONS}, got {self.fp32_precision!r}")


# "bf16x6" / "bf16x9": operands split into three bf16 pieces beforehand, six or nine
# tensor-core dots per K step (kernels/split_gemm.py; TMA, Hopper+).
FP32_PRECISIONS = ("ieee", "tf32x3", "bf16x6", "bf16x9")


# Chosen from the sweep in `python -m benchmarks gemm --sweep` on an H200 (docs/benchmarks.md):
# bf16 128x256x64, GROUP_M 16, 8 warps, 3 stages, TMA: 98-101% of cuBLAS at Llama-3-8B
# shapes (pointer loads: 77%; 4 stages do not fit in shared memory; flatten / warp
# specialisation / GROUP_M 8 or 32: no gain). fp32 (IEEE, FMA): 128x128x32, 84% of cuBLAS;
# tf32x3 (in-register split): 72%, so Hopper's fp32 is the pre-split bf16x6 kernel (below).
# Any fixed config is invariant; two different configs give
# different bits (different BLOCK_K or precision = different arithmetic), so these must
# not change silently between runs.
CUDA_CONFIGS = {
    torch.bfloat16: GemmConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True),
    torch.float16: GemmConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True),
    # fp32: operands pre-split into three bf16 pieces, six tensor-core dots per K step, each
    # K step's partial sum added on the FMA units (split_gemm.py): 156% of cuBLAS fp32 at
    # 4096^3 and 5x more accurate (2.3e-7 vs 1.15e-6 rel. error) on an H200; the IEEE FMA
    # tile (128x128x32 w8 s3 pointer, 84%) stays in CUDA_CONFIGS_PRE_HOPPER.
    torch.float32: GemmConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3, tma=True,
                              epilogue_subtile=True, fp32_precision="bf16x6"),
}
# Pre-Hopper GPUs (no TMA, less shared memory). Depends on the device, not on the shape.
CUDA_CONFIGS_PRE_HOPPER = {
    torch.bfloat16: GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    torch.float16: GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    torch.float32: GemmConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3),
}
# The IEEE fp32 FMA tile: pre-Hopper's fp32, TPDIAG_FP32_GEMM=ieee, tp-invariant-linear's groups.
IEEE_FP32_CONFIG = CUDA_CONFIGS_PRE_HOPPER[torch.float32]
# Under the Triton interpreter (CPU tensors): each tl.dot runs as a numpy matmul of one
# fixed tile shape. Smaller tiles keep the interpreter fast.
INTERPRETER_CONFIGS = {
    torch.bfloat16: GemmConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1),
    torch.float16: GemmConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1),
    torch.float32: GemmConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1),
}

@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]  # ~10 us a call uncached: once per GEMM adds up


def default_config(dtype: torch.dtype, device: torch.device, K: Optional[int] = None) -> GemmConfig:
    """The fixed config for ``dtype`` on ``device``. ``K`` is accepted (a config may depend
    on K, which fixes the reduction length anyway) but no shipped config uses it."""
    del K
    if device.type != "cuda":
        return INTERPRETER_CONFIGS[dtype]
    major = _major(device.index if device.index is not None else torch.cuda.current_device())
    if dtype == torch.float32 and os.environ.get("TPDIAG_FP32_GEMM") == "ieee":
        # IEEE fp32 on the FMA units everywhere (other bits than the Hopper default; set it
        # for every degree of a comparison - the worlds inherit the environment)
        return IEEE_FP32_CONFIG
    return (CUDA_CONFIGS if major >= 9 else CUDA_CONFIGS_PRE_HOPPER)[dtype]
