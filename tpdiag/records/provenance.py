"""Provenance every manifest.json carries: the versions a run's bits depend on."""
from __future__ import annotations

import platform

from tpdiag import __version__


def versions(device: str) -> dict:
    import torch

    v = {"tpdiag": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = None
    v["cuda"] = torch.version.cuda
    if device == "cuda":
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            v["nccl"] = None
    return v
