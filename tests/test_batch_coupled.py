"""A module whose result for a row depends on the other rows of its call (an MoE expert capacity
computed from the tokens per call) moves the logprobs with the micro-batch size far beyond
rounding, through a discrete choice (argmax). That is not a batch-variant kernel: it read
"batch-variant-kernel ... nothing is wrong" before, with the module 1.3e5x rounding from its
float64 re-execution. With its router's choices near ties (not clear: probes/float64), the
op-level pass's records of them (argmax's indices), equal on both sides, show no tie flipped: the
distance is a wrong result, a BUG at the module, saying why. The
same model routing every token is rounding (the twin)."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/moe_capacity.py:"
ARGS = ("--tp", "1", "--micro-batch", "4,1", "--batch-size", "4", "--seq-len", "16", "--no-baseline", "--no-confirm")


def _compare(tmp_path, factory):
    d = tmp_path / factory
    p = run_cli("compare", "--model", SPEC + factory, *ARGS, "--out", str(d))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    return d, s, s["configurations"]["1-mb1"]["first_divergence"], p.stdout


def test_capacity_dropping_is_a_bug_at_its_module(tmp_path):
    # the router's top-1 choices are near ties (dropping_close): not clear, so only the op-level
    # records of argmax's indices, equal on both sides, rule out a flip
    d, s, fd, out = _compare(tmp_path, "dropping_close")
    assert fd["module"] == "blocks.0.moe" and fd["oracle"]["far"], fd
    assert fd["oracle"].get("choices_equal") == ["aten::argmax"] and "discrete" not in fd["oracle"], fd["oracle"]
    assert fd["cause"] == "sharding-bug" and s["class"] == "bug", (fd["cause"], s["class"])
    assert "other rows of its call" in fd["why"], fd["why"]
    assert "nothing is wrong" not in out and "BUG" in out.splitlines()[0], out
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4


def test_routing_every_token_is_rounding(tmp_path):
    _, s, fd, _ = _compare(tmp_path, "routed")
    assert s["class"] == "rounding" and fd["cause"] == "batch-variant-kernel", (s["class"], fd)
    assert not fd["oracle"]["far"], fd["oracle"]


def test_in_bf16_a_float64_run_that_chose_otherwise_is_no_reference(tmp_path):
    # bf16: the float64 re-execution's argmax picks other experts than the bf16 reference's, so the
    # reference is itself far from it (0.165, 42 roundings) and a threshold scaled by that judged
    # this side "near" (0.33 against 1.32): batch-variant-kernel, "nothing is wrong". Now the
    # float64 value is no reference: unknown (fail closed)
    d = tmp_path / "bf16"
    p = run_cli("compare", "--model", SPEC + "dropping", *ARGS, "--dtype", "bfloat16", "--out", str(d))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    fd = s["configurations"]["1-mb1"]["first_divergence"]
    assert fd["oracle"].get("no_reference") and fd["oracle"]["ref_err"] > 8 * fd["oracle"]["floor"], fd["oracle"]
    assert fd["cause"] == "unknown" and s["class"] != "rounding", (fd["cause"], s["class"])
    assert "nothing is wrong" not in p.stdout, p.stdout
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 1
