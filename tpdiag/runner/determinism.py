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
                "ATEN_CPU_CAPABILITY", "TRITON_INTERPRET", "NVTE_TP_INVARIANT_MODE")


def numerics_env() -> dict[str, str]:
    return {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ}


def setup(seed: int, device: str) -> None:
    import torch

    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    # On CUDA, warn-only leaves fused attention backwards (cuDNN, memory-efficient) on their
    # atomic, run-to-run nondeterministic algorithms: seen on H200 as an unprobed and a probed
    # run of the same step differing in an attention weight after the optimizer step. Strict
    # mode makes them take their deterministic algorithms; an op with none raises, and the
    # world's error says how to go back (TPDIAG_DETERMINISM=warn).
    strict = device == "cuda" and os.environ.get("TPDIAG_DETERMINISM", "strict") != "warn"
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 silently changes fp32 GEMMs; the reference and every degree must use full fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
