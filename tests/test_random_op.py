"""A random draw in the sharded region (dropout in training mode) is located at its op and said
to be one: the verdict stays `unknown` (fail closed - not rounding, not a proven bug) and the
headline names `model :: aten::bernoulli_`. Before, it read "forward: in 0" and "no op there was
recorded" although the op-level pass had found the op."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/dropout_lm.py:target"


def test_dropout_is_named_a_random_draw(tmp_path):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", SPEC, "--tp", "1,2", "--no-baseline", "--no-confirm", "--out", str(d))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    fd = s["degrees"]["2"]["first_divergence"]
    assert "bernoulli" in fd["op"] and fd["cause"] == "unknown", fd
    assert "a random draw" in fd["why"], fd
    assert s["class"] != "rounding", s["class"]
    assert "forward: model :: aten::bernoulli_" in p.stdout and "no op there was recorded" not in p.stdout, p.stdout
    assert run_cli("gate", str(d), "--allow", "rounding").returncode != 0  # unknown never passes
