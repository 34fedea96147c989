"""A BUG found at an op names the line of the user's code that ran it (helper hnew14). A QK-norm over
the local columns (tests/models/planted/qk_norm_local.py) read `BUG at forward: attention ::
aten::mul` - one of the attention's many muls (RoPE, scaling, the norm's own), no line: the user
had to guess. Now the verdict, the gate and the report say `at qk_norm_local.py:LINE in forward`."""
import json
import os

from conftest import ROOT, run_cli

MODEL = os.path.join("tests", "models", "planted", "qk_norm_local.py")


def _line(text: str) -> int:
    return next(i for i, x in enumerate(open(os.path.join(ROOT, MODEL)), 1) if text in x)


def test_a_bug_at_an_op_names_the_users_line(tmp_path):
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{MODEL}:qk_local", "--tp", "1,2", "--forward-only",
                "--no-baseline", "--no-confirm", "--out", str(out), timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout
    at = f"{MODEL}:{_line('xq = F.rms_norm(xq, xq.shape[-1:])  # over the local')} in forward"
    head = p.stdout.splitlines()[0]
    assert head.startswith("verdict: divergent, BUG") and f":: aten::mul (at {at})" in head, p.stdout
    fd = json.loads((out / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    assert fd["op"] == "aten::mul" and fd["op_at"].endswith(at), fd
    g = run_cli("gate", str(out), timeout=120)
    assert g.returncode == 4 and f"enters at op aten::mul at {at})" in g.stdout, g.stdout
    # the record is wo's input, filed under the attention whose code computed it: say whose
    assert "record in 0 of attention.wo," in g.stdout, g.stdout
    r = run_cli("report", str(out), timeout=120)
    assert r.returncode == 0 and f"(op aten::mul at {at})" in (out / "report.html").read_text()
