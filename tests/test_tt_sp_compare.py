"""`tpdiag compare` on the two plan mistakes of tests/user_tt_team.py, written as a Target
(tests/models/planted/tt_sp.py): the attention without its sequence-parallel input layout reads BUG
(sharding-bug) at attention.wq's output, the first record the ranks hold only part of - main at
3c46cde failed the degree ("cannot be gathered", gate 2); the head tied to the embedding before the
plan reads BUG at the embedding's weight grad (the split tie); the correct plan rounding only."""
import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("variant,cls", [("good", "rounding"), ("sp_noprep", "bug"), ("tie_before", "bug")])
def test_compare_names_the_same_mistakes(tmp_path, variant, cls):
    out = tmp_path / variant
    p = run_cli("compare", "--model", f"py:tests/models/planted/tt_sp.py:{variant}", "--tp", "1,2",
                "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    e = s["degrees"]["2"]
    assert s["class"] == cls, e
    if variant == "sp_noprep":
        assert e["first_divergence"]["key"] == "s0/forward/attention.wq/out#0/0", e["first_divergence"]
        assert e["first_divergence"]["cause"] == "sharding-bug"
    if variant == "tie_before":
        f = e["findings"][0]
        assert (f["cause"], f["module"], f["kind"]) == ("sharding-bug", "embed", "param_grad"), f
    assert run_cli("gate", str(out), "--allow", "rounding").returncode == (0 if cls == "rounding" else 4)
