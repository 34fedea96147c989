"""Megatron's f written wrong in a user's hand-written TP (tests/models/planted/train_side.py):
the column-parallel MLP's input grad all-reduced twice (`f_twice`) or never (`f_missing`). The
wrong record is the grad at the embedding's OUTPUT - what the MLP's backward returned. It was
named `backward: embed (grad_out 0)` alone, sending the user to the embedding; the finding now
keeps the modules whose backward made it, and the verdict line names them. The twin with `f`
once reads rounding only (gate 1, never 4)."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/train_side.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("good", "f_twice", "f_missing"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (d, json.loads((d / "summary.json").read_text()), p.stdout)
    return out


def test_f_once_is_rounding_only(runs):
    d, s, _ = runs["good"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert run_cli("gate", str(d)).returncode == 1


@pytest.mark.parametrize("case,cause", [("f_twice", "sharding-bug"), ("f_missing", "rank-inconsistent-replica")])
def test_a_wrong_f_is_named_at_the_backward_that_made_it(runs, case, cause):
    from tpdiag.diff.classes import leading_bug

    d, s, stdout = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"].get("findings")
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == ("backward", "embed", "grad_out", cause), lead
    assert lead["consumers"] == ["mlp"], lead
    assert "BUG (a wrong result, not rounding) at TP=2 backward: embed (grad_out 0), returned by the backward " \
           "of mlp" in stdout, stdout
    g = run_cli("gate", str(d))
    assert g.returncode == 4, g.stdout + g.stderr
