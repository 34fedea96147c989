"""State a training forward writes into a BUFFER (tests/models/planted/balance_bias.py: DeepSeek-V3's
auxiliary-loss-free load-balancing bias, nudged after use from each rank's own experts' load, the
load's all-reduce forgotten). Step 0 is right; the replicated bias differs between the ranks after
it, and step 1 routes by it.

On 2d251fd no record held a buffer: the first divergence was step 1's `moe` output, every input it
read bitwise equal, cause `unknown` (its float64 re-execution refused: it writes state), and the BUG
was named downstream at step 1's `moe.router` output grad. Now every floating buffer the step wrote
is recorded after the step (kind "buffer", read by the next step's forward as a parameter is): the
bias itself is the BUG, rank-inconsistent, at step 0. The twin (the load all-reduced) is bitwise.
"""
import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("case", ["local_load", "global_load"])
def test_a_buffer_the_forward_writes_per_rank_is_the_bug(case, tmp_path):
    from tpdiag.diff.classes import leading_bug

    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/balance_bias.py:{case}", "--tp", "1,2",
                "--steps", "2", "--seq-len", "8", "--no-confirm", "--no-baseline", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    e = s["degrees"]["2"]
    gate = run_cli("gate", str(d)).returncode
    if case == "global_load":
        assert e["status"] == "bitwise", e.get("first_divergence")
        assert gate == 0
        return
    fd = e["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe/buffer#0/bias", "rank-inconsistent-replica"), fd
    lead = leading_bug(e)
    assert lead is not None and lead["key"] == fd["key"], lead
    assert "optimizer: moe (buffer bias, written during the step)" in p.stdout, p.stdout[-2000:]
    assert "unknown" not in p.stdout, p.stdout[-2000:]
    assert gate == 4
