"""A decode-only mistake computed in the model's own forward (RoPE taken one position early in
each one-token call: tests/models/planted/rope_decode.py) shows first as an input of layers.0,
2e9 ULPs off. It read `batch-variant-kernel ... nothing is wrong` (the axis rule assumed the
first divergence's inputs were equal, and it is an input) and named `layers` - a ModuleList that
never runs - as the code that computed it. Now the caller is the model and the verdict fails
closed: `unknown`, saying no op there was judged; the gate never passes it."""
import json

from conftest import run_cli


def test_a_decode_input_off_by_far_is_not_rounding(tmp_path):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/rope_decode.py:target", "--tp", "1",
                "--mode", "prefill,decode", "--forward-only", "--no-baseline", "--out", str(d))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    fd = s["configurations"]["1-decode"]["first_divergence"]
    assert fd["kind"] == "in" and fd["key"].startswith("s0/forward/layers.0/in#"), fd
    assert fd["module"] == "model", fd["module"]  # the caller that ran, not the ModuleList
    assert fd["cause"] == "unknown" and s["class"] != "rounding", (fd["cause"], s["class"])
    assert "nothing is wrong" not in p.stdout, p.stdout
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 1  # unknown is never allowed
