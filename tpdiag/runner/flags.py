"""The backend flags a run computes under - themselves an axis of what a run's bits are.

Two settings:
- `deterministic` (compare's default): deterministic algorithms (strict on CUDA), cuDNN
  deterministic and not benchmarking, TF32 off (cuBLAS and cuDNN), no reduced-precision
  (fp16/bf16) GEMM reductions, a fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8).
  Reproducible run to run; not what an engine or a trainer runs unless it opts in.
- `default` (rollout's default): PyTorch's own defaults - deterministic algorithms off, cuDNN
  not deterministic and not benchmarking, cuBLAS TF32 off and cuDNN TF32 on (fp32 convolutions
  only), float32 matmul precision 'highest', fp16/bf16 reduced-precision GEMM reductions allowed,
  no cuBLAS workspace config (cuBLAS's own default workspace). What `generate()`, vLLM and most
  trainers run; on a GPU its bf16 GEMMs may take other (split-K, reduced-precision) algorithms
  than the deterministic setting's, so their bits differ.

SDPA's backends (flash, memory-efficient, math, cuDNN) are left enabled in both: which one runs
depends on the device, dtype and shapes; `snapshot()` records which are enabled.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from tpdiag.base.configs import FLAGS as SETTINGS  # noqa: E402 - the configuration axis

CUBLAS_ENV, CUBLAS_VALUE = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"


def parse(option: str, text: str) -> tuple[str, ...]:
    from tpdiag.errors import BadInput

    out = tuple(p.strip().lower() for p in str(text).split(",") if p.strip())
    bad = [p for p in out if p not in SETTINGS]
    if bad or not out:
        raise BadInput(f"{option} {text!r}: expected {' or '.join(SETTINGS)} (comma-separated to try both)")
    from tpdiag.base.points import no_repeat

    no_repeat(option, text, out)
    return out


# What differs between the two settings; both keep TF32 off for fp32 GEMMs (matmul precision
# "highest", cuda.allow_tf32 False) and cuDNN's benchmark off. deterministic: TF32 silently changes
# fp32 GEMMs and cuDNN convolutions, and reduced-precision reductions round bf16/fp16 partial sums,
# so the reference and every degree run full precision; default: PyTorch's own values.
_TABLE = {
    "deterministic": {"algorithms": True, "cudnn_deterministic": True, "cudnn_tf32": False, "reduced": False},
    "default": {"algorithms": False, "cudnn_deterministic": False, "cudnn_tf32": True, "reduced": True},
}


def apply(setting: str, device: str) -> None:
    """Set `setting`'s flags for the rest of the process (a world's ranks: before the first GEMM,
    so the cuBLAS workspace follows too)."""
    import torch

    if setting not in _TABLE:
        from tpdiag.errors import BadInput

        raise BadInput(f"flags {setting!r}: expected {' or '.join(SETTINGS)}")
    t = _TABLE[setting]
    cuda = torch.backends.cuda.matmul
    if t["algorithms"]:
        os.environ[CUBLAS_ENV] = CUBLAS_VALUE
        # On CUDA, warn-only leaves fused attention backwards (cuDNN, memory-efficient) on their
        # atomic, run-to-run nondeterministic algorithms: strict makes them take their
        # deterministic ones; an op with none raises (TPDIAG_DETERMINISM=warn goes back)
        strict = device == "cuda" and os.environ.get("TPDIAG_DETERMINISM", "strict") != "warn"
        torch.use_deterministic_algorithms(True, warn_only=not strict)
    else:
        os.environ.pop(CUBLAS_ENV, None)
        torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = t["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    cuda.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = t["cudnn_tf32"]
    cuda.allow_fp16_reduced_precision_reduction = t["reduced"]
    cuda.allow_bf16_reduced_precision_reduction = t["reduced"]


def snapshot() -> dict:
    """The flags in force now, and SDPA's enabled backends."""
    import torch

    cuda = torch.backends.cuda
    out = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "matmul_tf32": bool(cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced_precision_reduction": bool(cuda.matmul.allow_fp16_reduced_precision_reduction),
        "bf16_reduced_precision_reduction": bool(cuda.matmul.allow_bf16_reduced_precision_reduction),
        "cublas_workspace_config": os.environ.get(CUBLAS_ENV),
        "sdpa_enabled": [name for name, on in (
            ("flash", cuda.flash_sdp_enabled()), ("mem_efficient", cuda.mem_efficient_sdp_enabled()),
            ("math", cuda.math_sdp_enabled()),
            ("cudnn", getattr(cuda, "cudnn_sdp_enabled", lambda: False)())) if on],
    }
    return out


def one_line(snap: dict, setting: str | None = None) -> str:
    """The snapshot in one line, e.g. 'flags default: deterministic off, TF32 matmul off ...'."""
    def on(x):
        return "on" if x else "off"

    det = on(snap.get("deterministic_algorithms"))
    if snap.get("deterministic_algorithms") and snap.get("deterministic_warn_only"):
        det += " (warn only)"
    head = f"flags {setting}: " if setting else "flags: "
    return (head + f"deterministic algorithms {det}, cuDNN deterministic "
            f"{on(snap.get('cudnn_deterministic'))} benchmark {on(snap.get('cudnn_benchmark'))}, TF32 "
            f"matmul {on(snap.get('matmul_tf32'))} cuDNN {on(snap.get('cudnn_tf32'))} (fp32 precision "
            f"{snap.get('float32_matmul_precision')}), reduced-precision reductions fp16 "
            f"{on(snap.get('fp16_reduced_precision_reduction'))} bf16 "
            f"{on(snap.get('bf16_reduced_precision_reduction'))}, CUBLAS_WORKSPACE_CONFIG "
            f"{snap.get('cublas_workspace_config') or 'unset'}, SDPA backends enabled "
            f"{'/'.join(snap.get('sdpa_enabled') or []) or 'none'}")


def save_state() -> dict:
    """Every setting apply() and tpdiag.set_deterministic touch, to put back (restore_state)."""
    import torch

    cuda = torch.backends.cuda.matmul
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "precision": torch.get_float32_matmul_precision(),
        "cuda_tf32": cuda.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "fp16_reduced": cuda.allow_fp16_reduced_precision_reduction,
        "bf16_reduced": cuda.allow_bf16_reduced_precision_reduction,
        "cublas_env": os.environ.get(CUBLAS_ENV),
        "threads": torch.get_num_threads(),
    }


def restore_state(s: dict) -> None:
    import torch

    cuda = torch.backends.cuda.matmul
    torch.use_deterministic_algorithms(s["algorithms"], warn_only=s["warn_only"])
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = s["cudnn_benchmark"]
    # the precision setting also sets the TF32 flags: restore it first, then the flags
    torch.set_float32_matmul_precision(s["precision"])
    cuda.allow_tf32 = s["cuda_tf32"]
    torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
    cuda.allow_fp16_reduced_precision_reduction = s["fp16_reduced"]
    cuda.allow_bf16_reduced_precision_reduction = s["bf16_reduced"]
    if s["cublas_env"] is None:
        os.environ.pop(CUBLAS_ENV, None)
    else:
        os.environ[CUBLAS_ENV] = s["cublas_env"]
    if torch.get_num_threads() != s["threads"]:
        torch.set_num_threads(s["threads"])


@contextmanager
def applied(setting: str, device: str):
    """`setting`'s flags for a `with` block (tpdiag rollout's TP=1, in this process); every flag is
    put back on exit."""
    saved = save_state()
    try:
        apply(setting, device)
        yield snapshot()
    finally:
        restore_state(saved)
