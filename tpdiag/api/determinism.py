"""The process settings a bitwise-reproducible run needs, for a user's own script.

`set_deterministic()` sets them for the rest of the process (a training script's first line);
`deterministic()` sets them for a `with` block and puts every one back in `finally`. Both are
public (`tpdiag.set_deterministic`, `tpdiag.deterministic`); `tpdiag.invariant` enters the
second. tpdiag's own worlds set the same things in runner/determinism.py, plus the rank
environment a launcher must export before torch starts.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from tpdiag.runner.flags import CUBLAS_ENV, CUBLAS_VALUE, restore_state, save_state

# CUBLAS_VALUE (runner/flags.py): cuBLAS picks a reduction split per workspace size; a fixed workspace config is what
# torch's deterministic mode requires of cuBLAS GEMMs (read when a cuBLAS handle first
# allocates its workspace: set before the first GPU GEMM of the process to take effect).


def _check(warn_only, cpu_threads) -> None:
    from tpdiag.errors import BadInput

    if not isinstance(warn_only, bool):
        raise BadInput(f"warn_only={warn_only!r}: expected True or False")
    if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                    or cpu_threads < 1):
        raise BadInput(f"cpu_threads={cpu_threads!r}: expected a positive int or None (unchanged)")


def _apply(seed, warn_only: bool, cpu_threads) -> None:
    import torch

    os.environ.setdefault(CUBLAS_ENV, CUBLAS_VALUE)
    # strict by default: a fused attention backward (cuDNN, memory-efficient) otherwise keeps
    # its atomic, run-to-run nondeterministic algorithm with only a warning
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 silently rounds fp32 GEMM inputs to 10 mantissa bits
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if seed is not None:
        torch.manual_seed(seed)  # every device's generator, CUDA included


def set_deterministic(seed: int | None = None, *, warn_only: bool = False,
                      cpu_threads: int | None = None) -> None:
    """Deterministic algorithms (strict unless warn_only), cuDNN deterministic and not
    benchmarking, TF32 and reduced-precision GEMM reductions off, CUBLAS_WORKSPACE_CONFIG set
    when unset, and optionally the seed and the CPU thread count. For the rest of the process."""
    _check(warn_only, cpu_threads)
    _apply(seed, warn_only, cpu_threads)


@contextmanager
def deterministic(seed: int | None = None, *, warn_only: bool = False, cpu_threads: int | None = None):
    """set_deterministic for a `with` block; every setting it touches is put back on exit (the
    seeded RNG state is not: what was drawn was drawn)."""
    _check(warn_only, cpu_threads)
    saved = save_state()
    try:
        _apply(seed, warn_only, cpu_threads)
        yield
    finally:
        restore_state(saved)
