"""Provenance every manifest.json carries: the versions a run's bits depend on."""
from __future__ import annotations

import platform
import re
import sys

from tpdiag import __version__

# how Triton's __init__.py spells its version: one literal (a build writes it there)
_TRITON_VERSION = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]\s*$""", re.M)


def versions(device: str) -> dict:
    import torch

    v = {"tpdiag": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        v["triton"] = _triton_version()
    except Exception:
        v["triton"] = None
    v["cuda"] = torch.version.cuda
    if device == "cuda":
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            v["nccl"] = None
    return v


def _triton_version() -> str:
    """triton.__version__, read from the literal its __init__.py assigns rather than by importing it:
    every compare pass writes its manifest before its first world starts, and on a host where this
    process needs no Triton kernel (gloo on the CPU) the import was 0.7-0.9 s of that wait on a
    2-core machine. Imported as before where Triton is already loaded or its file spells no literal."""
    if "triton" in sys.modules:  # loaded (None there: a test's "no Triton", which raises here)
        return sys.modules["triton"].__version__
    from importlib.util import find_spec

    spec = find_spec("triton")  # finds, never imports; None: not installed
    if spec is None or not spec.origin:
        raise ImportError("no triton")
    with open(spec.origin, encoding="utf-8") as f:
        m = _TRITON_VERSION.search(f.read())
    if m is not None:
        return m.group(1)
    import triton

    return triton.__version__
