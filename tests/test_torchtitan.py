"""A real external client: torchtitan's own Llama3 with torchtitan's own TP sharding, captured
under torchrun at TP=1 and TP=2 (examples/torchtitan_capture.py) and diffed by `tpdiag diff`.
Runs only where the `torchtitan` package imports (pip install 'tpdiag[torchtitan]')."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

try:
    import torchtitan.models.llama3  # noqa: F401
    _MISSING = None
except Exception as e:  # noqa: BLE001 - not installed, or its own deps (spmd_types, ...) missing
    _MISSING = f"torchtitan not importable here ({type(e).__name__}: {e}); pip install 'tpdiag[torchtitan]'"

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
EXAMPLE = os.path.join(ROOT, "examples", "torchtitan_capture.py")


def _capture(out, n):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={n}", EXAMPLE, "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout
    return out


def test_torchtitan_llama3_tp1_vs_tp2(tmp_path):
    a, b = _capture(tmp_path / "tp1", 1), _capture(tmp_path / "tp2", 2)
    p = run_cli("diff", str(a), str(b), "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(p.stdout)
    assert s["status"] == "divergent", s
    (d,) = s["degrees"].values()
    fd = d["first_divergence"]
    # torchtitan shards wqkv/w1/w3 column-wise and wo/w2 row-wise: on CPU fp32 the column
    # shards are bitwise, the first difference is a layer-0 row-parallel all-reduce
    assert fd["phase"] == "forward" and fd["kind"] == "out", fd
    assert fd["module"] in ("layers.0.attention.wo", "layers.0.feed_forward.w2"), fd
    assert fd["cause"] == "row-parallel-reduction" and 0 < fd["max_abs"] <= fd["bound"], fd
    assert d["findings"] == [] and d["unmatched"] == [] and d["missing"] == []
    assert d["logprobs"]["bitwise"] is False and d["logprobs"]["tokens"] == 30
