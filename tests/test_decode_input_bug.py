"""A decode-only mistake computed in the model's own forward (RoPE taken one position early in
each one-token call: tests/models/planted/rope_decode.py) shows first as an input of layers.0,
2e9 ULPs off. It read `batch-variant-kernel ... nothing is wrong` (the axis rule assumed the
first divergence's inputs were equal, and it is an input), then `unknown` (the row was picked by a
slice, a view that the op probe did not record). Now the op probe records a slice or select of the
model's own parameter or buffer with its source: the source is bitwise equal, the pick is not -
a pick computes no number, so it picked other rows: BUG, at the slice in the model's forward.
The twin (every call at its own positions) reads rounding."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/rope_decode.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("target", "twin"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1", "--mode", "prefill,decode",
                    "--forward-only", "--no-baseline", "--no-confirm", "--out", str(d))
        assert p.returncode == 0, p.stderr[-3000:]
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout,
                     run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


def test_a_decode_input_picked_wrong_is_a_bug_at_the_slice(runs):
    s, stdout, gate = runs["target"]
    fd = s["configurations"]["1-decode"]["first_divergence"]
    assert fd["kind"] == "in" and fd["key"].startswith("s0/forward/layers.0/in#"), fd
    assert fd["module"] == "model", fd["module"]  # the caller that ran, not the ModuleList
    assert fd["op"] == "aten::slice" and fd["cause"] == "sharding-bug", (fd["op"], fd["cause"], fd.get("why"))
    assert "picked other elements" in fd["why"] and "input 1 of layers.0" in fd["why"], fd["why"]
    assert fd["op_oracle"]["far"] and fd["op_oracle"]["ref_err"] == 0.0, fd["op_oracle"]  # a pick is exact
    assert s["class"] == "bug" and "nothing is wrong" not in stdout
    assert gate == 4


def test_its_twin_reads_rounding(runs):
    s, stdout, gate = runs["twin"]
    fd = s["configurations"]["1-decode"]["first_divergence"]
    assert s["class"] == "rounding" and fd["cause"] == "batch-variant-kernel", (s["class"], fd)
    assert gate == 0
