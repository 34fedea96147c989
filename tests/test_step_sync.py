"""A mistake that only the second step's backward shows (tests/models/planted/step_sync.py): a
replicated gain whose grad the user sums over the TP ranks in a hook guarded by a flag that is never
cleared, so only step 0's grad is summed. Run as a user runs it, `--steps 2`.

The verdict was right on e403778 (a BUG at step 1's `mlp` gain grad, rank-inconsistent-replica; the
twin rounding only), but the text named the record without its step - 'backward: mlp (param_grad
gain)' - as if step 0 held it; cli/record_words.where now says 'step 1 backward: ...' for a later step.
"""
import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("case", ["sync_once", "sync_every"])
def test_a_grad_sync_only_the_first_step_runs(case, tmp_path):
    from tpdiag.diff.classes import leading_bug

    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/step_sync.py:{case}", "--tp", "1,2", "--steps", "2",
                "--no-confirm", "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    e = s["degrees"]["2"]
    gate = run_cli("gate", str(d)).returncode
    if case == "sync_every":
        assert s["class"] == "rounding" and not e.get("findings"), e.get("findings")
        assert gate == 1 and "BUG" not in p.stdout, p.stdout[-1500:]
        return
    lead = leading_bug(e)
    assert lead is not None and (lead["key"], lead["cause"]) == (
        "s1/backward/mlp/param_grad#0/gain", "rank-inconsistent-replica"), lead
    assert not any(f["key"].startswith("s0/") for f in e["findings"]), e["findings"]
    assert "step 1 backward: mlp (param_grad gain)" in p.stdout, p.stdout[-2000:]
    assert gate == 4
