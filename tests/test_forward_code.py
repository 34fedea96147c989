"""Mistakes in the model's OWN forward code, outside any submodule (tests/models/planted/
forward_code.py), each beside its twin, run as a user runs them. A pick of the model's own
parameter (a tied head's rows by F.linear, learned positions by index) is recorded with its source
(probes/op_probe.py): the source bitwise equal, the pick not -> BUG at the pick, gate exit 4.
Main at 8e99245 already read BUG for all three (an op far from its float64 re-execution), naming
head_slice's matmul after the pick; now the pick itself, and why a pick cannot be rounding."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/forward_code.py:"
TP = ("--tp", "1,2")
MB = ("--tp", "1", "--micro-batch", "2,1")
NC = ("--no-confirm",)
CASES = {"head_slice": TP + NC, "shard_max": TP + NC, "head_ok": TP + NC, "flat_pos": MB + NC, "row_pos": MB + NC,
         # the mistake sits behind a rounding (the row-parallel sum before it): the confirmation
         # rerun's next first divergence is judged too
         "residual_twice": TP, "residual_once": TP}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, axes in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, *axes, "--forward-only", "--no-baseline",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:])
        s = json.loads((d / "summary.json").read_text())
        out[case] = (s, p.stdout, run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


def _fd(s, label):
    return (s.get("configurations") or s["degrees"])[label]["first_divergence"]


@pytest.mark.parametrize("case,label,op", [("head_slice", "2", "aten::slice"), ("shard_max", "2", "aten::sub"),
                                           ("flat_pos", "1-mb1", "aten::index")])
def test_a_mistake_in_the_forward_code_is_a_bug_there(runs, case, label, op):
    s, stdout, gate = runs[case]
    assert s["class"] == "bug", (case, s["class"], _fd(s, label))
    fd = _fd(s, label)
    assert fd["module"] == "model" and fd["op"] == op, (case, fd)
    assert f"BUG at forward: model :: {op}" in stdout, stdout
    assert gate == 4, case


def test_a_pick_of_the_models_own_tensor_says_so(runs):
    s, _, _ = runs["flat_pos"]
    fd = _fd(s, "1-mb1")
    assert fd["cause"] == "sharding-bug" and "picked other elements" in fd["why"], fd
    assert fd["op_oracle"]["ref_err"] == 0.0  # a pick is exact: the reference IS its float64 value


def test_a_mistake_behind_a_rounding_is_found_by_the_confirmation(runs):
    """Main at 8e99245: `rounding only` (the row-parallel sum's rounding came first; the confirming
    rerun's next divergence, the input of norm, read `unknown` and was dropped), gate exit 0."""
    s, stdout, gate = runs["residual_twice"]
    e = s["degrees"]["2"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    bug = next(f for f in e["findings"] if f.get("cause") == "sharding-bug")
    assert bug["from"].startswith("confirmation") and bug["made_in"] == "model" and bug["op"] == "aten::add", bug
    assert "computes another function" in bug["why"], bug["why"]
    assert s["class"] == "bug" and "BUG     forward: model :: aten::add" in stdout, stdout[-2000:]
    assert gate == 4


@pytest.mark.parametrize("case", ["head_ok", "row_pos", "residual_once"])
def test_the_twins_are_not_bugs(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] in ("rounding", "bitwise", None) and "BUG" not in stdout, (case, s.get("class"), stdout[-1500:])
    assert gate == 0, case
