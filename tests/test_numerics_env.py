"""An environment variable that selects a kernel's arithmetic is recorded in the manifest's
numerics environment (runner/determinism.py NUMERICS_ENV; issue 62 item 4): TPDIAG_FP32_GEMM picks
invariant-gemm's fp32 tile on CUDA (other bits), so two runs that differ in it say so."""
from __future__ import annotations

import os
import re

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpdiag")
# the modules whose environment variables choose how a kernel computes (not how fast, not what is logged)
ARITHMETIC = [os.path.join("kernels", "invariant_gemm_config.py"), os.path.join("kernels", "tree.py")]


def unrecorded(sources: list[str], recorded) -> set[str]:
    """The variables these sources read from the environment that `recorded` leaves out."""
    read = {m for s in sources for m in re.findall(r"environ(?:\.get\(|\[)\s*['\"]([A-Z0-9_]+)['\"]", s)}
    return read - set(recorded)


def _sources() -> list[str]:
    out = []
    for rel in ARITHMETIC:
        with open(os.path.join(ROOT, rel)) as f:
            out.append(f.read())
    return out


def test_every_arithmetic_switch_is_recorded():
    from tpdiag.runner.determinism import NUMERICS_ENV

    assert not unrecorded(_sources(), NUMERICS_ENV)
    # negative control: the list as it was before TPDIAG_FP32_GEMM was recorded misses it
    before = tuple(k for k in NUMERICS_ENV if k != "TPDIAG_FP32_GEMM")
    assert unrecorded(_sources(), before) == {"TPDIAG_FP32_GEMM"}


def test_the_manifest_env_carries_it(monkeypatch):
    from tpdiag.runner.determinism import numerics_env

    monkeypatch.delenv("TPDIAG_FP32_GEMM", raising=False)
    assert "TPDIAG_FP32_GEMM" not in numerics_env()
    monkeypatch.setenv("TPDIAG_FP32_GEMM", "ieee")
    assert numerics_env()["TPDIAG_FP32_GEMM"] == "ieee"
