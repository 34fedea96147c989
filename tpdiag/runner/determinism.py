"""Everything that makes a run reproducible, set in one place before anything runs."""
from __future__ import annotations

import os

# Environment that must be in place before torch/CUDA initialise in a rank.
RANK_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}

# Variables whose values change numerics; the manifest records them.
NUMERICS_ENV = ("TPDIAG_DETERMINISM", "TPDIAG_TREE_GROUPS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO",
                "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE", "ONEDNN_MAX_CPU_ISA",
                "ATEN_CPU_CAPABILITY", "TRITON_INTERPRET", "NVTE_TP_INVARIANT_MODE",
                # invariant-gemm's fp32 tile on CUDA (kernels/invariant_gemm_config.py): 'ieee' FMA
                # tiles, else three bf16 pieces per operand - other bits
                "TPDIAG_FP32_GEMM")


def numerics_env() -> dict[str, str]:
    return {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ}


def setup(seed: int, device: str, flags: str = "deterministic") -> None:
    """A rank's process: the rank environment, one thread, the seed, and the run's backend flags
    (tpdiag.runner.flags: `deterministic`, compare's default, or PyTorch's `default`)."""
    import torch

    from tpdiag.runner import flags as backend_flags

    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    backend_flags.apply(flags, device)
