"""A norm over the FFN's hidden activations with the user's own all-reduce of the sum of squares
(helper hnew17; tests/models/planted/ffn_hidden_norm.py). Under tp-invariant-linear the first
difference is that all-reduce, inside the FFN's own code, feeding w2's input: the FFN re-executed in
float64 from its bitwise-equal inputs is within rounding, yet it read `unknown` ("no rule judged
it") - the verdict `not judged`, under `--fix auto` the whole run's, and `gate --allow rounding`
failed a correct model. Now `row-parallel-reduction` there, rounding; the norm over the local
columns is still a BUG at its op, and the all-reduce autograd passes over is a BUG in backward."""
import json

import pytest

from conftest import run_cli

MODEL = "py:tests/models/planted/ffn_hidden_norm.py"
ARGS = ("--tp", "1,2", "--fix", "tp-invariant-linear", "--no-baseline")


def _run(tmp_path, func, *extra):
    out = tmp_path / func
    p = run_cli("compare", "--model", f"{MODEL}:{func}", *ARGS, *extra, "--out", str(out), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    return out, p.stdout, json.loads((out / "summary.json").read_text())["degrees"]["2"]


def test_the_users_own_all_reduce_of_partial_sums_reads_rounding(tmp_path):
    out, stdout, d = _run(tmp_path, "global_", "--forward-only")
    fd = d["first_divergence"]
    assert (fd["module"], fd["op"], fd["kind"]) == ("layer.feed_forward", "c10d::allreduce_", "in"), fd
    assert fd["cause"] == "row-parallel-reduction" and d["class"] == "rounding", (fd, d["class"])
    assert stdout.startswith("verdict: divergent, rounding only"), stdout
    assert "whose first op that differs is the collective c10d::allreduce_" in stdout, stdout
    g = run_cli("gate", str(out), "--allow", "rounding", timeout=120)
    assert g.returncode == 0, g.stdout


@pytest.mark.parametrize("func, extra, phase", [("local", ("--forward-only",), "forward"),
                                                ("global_nograd", (), "backward")])
def test_the_wrong_twins_still_read_bug(tmp_path, func, extra, phase):
    out, stdout, d = _run(tmp_path, func, *extra)
    assert d["class"] == "bug" and stdout.startswith(f"verdict: divergent, BUG (a wrong result, not rounding) at TP=2 {phase}: layer.feed_forward"), stdout
    assert run_cli("gate", str(out), "--allow", "rounding", timeout=120).returncode == 4
