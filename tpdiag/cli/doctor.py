"""`tpdiag doctor`: what this machine offers and which settings change numerics."""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass


def collect() -> dict:
    import torch
    import torch.distributed as dist

    from tpdiag.records.provenance import versions
    from tpdiag.runner.determinism import numerics_env

    cuda = torch.cuda.is_available()
    info = {
        "versions": versions("cuda" if cuda else "cpu"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "max_cpu_tp_hint": "TP=8 on gloo oversubscribes a 2-core machine; it works, slowly",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "numerics_env": numerics_env(),
    }
    return info


OK, BAD, INFO = "ok", "will make results non-reproducible", "informational"


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    verdict: str  # OK | BAD | INFO
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


# CUBLAS_WORKSPACE_CONFIG values under which cuBLAS picks the same algorithm every run.
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def assess(info: dict) -> list[Check]:
    """One verdict per setting `collect` reports. tpdiag sets determinism up itself in every
    world it starts (tpdiag/runner/determinism.py), so this process's torch flags only matter for
    your own jobs; environment variables are inherited by the worlds and do matter."""
    v = info.get("versions") or {}
    out = [Check("versions", ", ".join(f"{k} {x}" for k, x in v.items() if x), INFO,
                 "recorded in every manifest.json; supported versions: docs/install.md"),
           Check("platform", str(info.get("platform")), INFO),
           Check("cpu", f"{info.get('cpu_count')} cores, {info.get('cpu_capability')} kernels", INFO,
                 "CPU results are comparable only between machines with the same kernel capability")]
    out.append(Check("gloo (CPU worlds)", "available" if info.get("gloo") else "missing",
                     OK if info.get("gloo") else INFO, "" if info.get("gloo") else "compare --device cpu cannot run"))
    gpus = info.get("gpus") or []
    cuda = f"{len(gpus)} GPU(s): {', '.join(gpus)}" if info.get("cuda_available") else "not available"
    out.append(Check("cuda", cuda, INFO, "" if info.get("cuda_available") else "compare runs on the CPU with gloo"))
    out.append(Check("nccl (GPU worlds)", "available" if info.get("nccl") else "missing", INFO))
    tf32 = info.get("tf32_matmul")
    out.append(Check("TF32 matmul in this process", str(tf32), INFO if tf32 else OK,
                     "tpdiag turns TF32 off in its own worlds; a job of yours with it on rounds fp32 GEMMs "
                     "to TF32"))
    det = info.get("deterministic_algorithms")
    out.append(Check("deterministic algorithms in this process", str(det), OK if det else INFO,
                     "tpdiag turns them on in its own worlds; matters only for your own jobs"
                     + ("" if det else " (there it lets some CUDA kernels use run-to-run nondeterministic "
                                       "atomics)")))
    env = info.get("numerics_env") or {}
    if not env:
        out.append(Check("numerics environment", "none of the variables that change numerics is set", OK))
    for k, x in env.items():
        out.append(_env_check(k, x))
    if info.get("max_cpu_tp_hint"):
        out.append(Check("cpu worlds", str(info["max_cpu_tp_hint"]), INFO))
    return out


def _env_check(k: str, x: str) -> Check:
    name = f"env {k}"
    if k == "TPDIAG_DETERMINISM" and x == "warn":
        return Check(name, x, BAD, "CUDA kernels without a deterministic algorithm (fused attention "
                                   "backwards) may differ run to run; the reference rerun will catch it")
    if k == "CUBLAS_WORKSPACE_CONFIG" and x not in _CUBLAS_DETERMINISTIC:
        return Check(name, x, BAD, f"cuBLAS is run-to-run deterministic only with {' or '.join(_CUBLAS_DETERMINISTIC)}")
    if k in ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") and x not in ("0", ""):
        return Check(name, x, BAD, "forces TF32 into fp32 GEMMs although tpdiag turns it off: "
                                   "results differ from machines without it")
    if k == "TRITON_INTERPRET" and x == "1":
        return Check(name, x, INFO, "Triton kernels run in the interpreter (CPU): slow, same order of operations")
    return Check(name, x, INFO, "inherited by every world and recorded in manifest.json; "
                                "compare only runs made with the same value")
