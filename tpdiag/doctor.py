"""`tpdiag doctor`: what this machine offers and which settings change numerics."""
from __future__ import annotations

import os
import platform


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
