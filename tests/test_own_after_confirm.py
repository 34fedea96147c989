"""After a hash-first pass the own-input judgement (each divergent module re-executed in float64
from its own side's inputs) runs after the confirmation, and only on the modules the confirming
fix leaves divergent: a bug verdict on a record the fixes make bitwise is dismissed anyway
(DESIGN.md). Where the fix leaves nothing divergent it does not run (at real sizes it was half
of a compare: llama-1b bf16 8x4096 --micro-batch 8,1, docs/gpu.md); where the fix confirms
nothing, every module is judged, and a bug behind the first divergence is still named."""
import json

from conftest import run_cli

HASH = ("--capture", "hash", "--no-baseline", "--format", "json")


def _compare(d, *args):
    p = run_cli("compare", *args, *HASH, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return json.loads(p.stdout)


def test_nothing_left_divergent_nothing_judged_late(tmp_path):
    s = _compare(tmp_path / "mb", "--tp", "1", "--micro-batch", "2,1", "--batch-size", "2", "--seq-len", "8")
    d = s["configurations"]["1-mb1"]
    assert d["own_inputs_hash"], d  # modules were waiting for the own-input judgement
    assert d["confirmation"]["verdict"] == "confirmed" and d["confirmation"]["status_after"] == "bitwise", d
    assert s["second_pass"]["own_after_confirm"] == {"1-mb1": []}, s["second_pass"]
    assert not (tmp_path / "mb" / "region" / "ops").exists()  # no own-input pass ran
    assert s["class"] == "rounding"
    assert run_cli("gate", str(tmp_path / "mb"), "--allow", "rounding").returncode == 0


def test_a_bug_behind_the_first_divergence_is_still_judged_after_the_confirmation(tmp_path):
    s = _compare(tmp_path / "bugs", "--model", "py:tests/models/planted/behind.py:bugs", "--tp", "1,2")
    d = s["degrees"]["2"]
    assert d["confirmation"]["verdict"] != "confirmed" or d["confirmation"]["status_after"] != "bitwise", d
    assert "kv" in s["second_pass"]["own_after_confirm"]["2"], s["second_pass"]
    kv = {f["name"]: f for f in d["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")}
    assert kv["wv"]["cause"] == "sharding-bug" and kv["wv"]["oracle"]["own"], kv
    assert s["class"] == "bug"
    assert run_cli("gate", str(tmp_path / "bugs"), "--allow", "rounding").returncode == 4
