"""Megatron's f written wrong in a user's hand-written TP (tests/models/planted/train_side.py):
the column-parallel MLP's input grad all-reduced twice (`f_twice`) or never (`f_missing`). The
wrong record is the grad at the embedding's OUTPUT - what the MLP's backward returned. It was
named `backward: embed (grad_out 0)` alone, sending the user to the embedding; the finding now
keeps the modules whose backward made it, and the verdict line names them. The twin with `f`
once reads rounding only (gate 1, never 4).

Also from that file: a tied embedding/head weight held by the root module whose grad is summed on
the embedding's side only - named `backward: weight (param_grad; a parameter of the root
module)`, no longer `backward: param_grad weight` as if it were a whole-model record like the
loss; and a dropout mask drawn per shard from one seed in the column-parallel region - the first
divergent op is the draw, said to be one (it read "no rounding model fits ... MLP computes
something else"); and dropout on the replicated residual stream drawn from a generator seeded by
the rank - the input of the norm after it is rank-inconsistent, and the line now says it was
computed in the model's own forward code (it read `forward: norm (in 0)`, pointing at the norm)."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/train_side.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    # (f_missing, the all-reduce forgotten, reads the same with rank-inconsistent-replica: not
    # rerun here, the same naming path)
    for case, more in (("good", ()), ("f_twice", ()), ("tied_one", ()),
                       ("tp_dropout_same", ("--forward-only",)), ("rep_dropout", ("--forward-only",))):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    *more, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (d, json.loads((d / "summary.json").read_text()), p.stdout)
    return out


def test_f_once_is_rounding_only(runs):
    d, s, _ = runs["good"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert run_cli("gate", str(d)).returncode == 1


def test_a_wrong_f_is_named_at_the_backward_that_made_it(runs, case="f_twice", cause="sharding-bug"):
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


def test_a_tied_weight_of_the_root_module_is_named_as_a_parameter(runs):
    d, s, stdout = runs["tied_one"]
    fd = s["degrees"]["2"]["first_divergence"]
    lead = next(f for f in s["degrees"]["2"]["findings"] if "follows" not in f)
    assert (lead["phase"], lead["module"], lead["kind"], lead["name"], lead["cause"]) == (
        "backward", "model", "param_grad", "weight", "rank-inconsistent-replica"), lead
    assert fd["cause"] == "row-parallel-reduction", fd  # the MLP's all-reduce before it: rounding
    assert "at TP=2 backward: weight (param_grad; a parameter of the root module)" in stdout, stdout
    assert run_cli("gate", str(d)).returncode == 4


def test_a_mask_drawn_per_shard_is_said_to_be_a_random_draw(runs):
    d, s, stdout = runs["tp_dropout_same"]
    fd = s["degrees"]["2"]["first_divergence"]
    assert (fd["module"], fd["op"], fd["cause"]) == ("mlp", "aten::rand", "unknown"), fd
    assert "a random draw" in fd["why"] and "computes something else" not in fd["why"], fd
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 1  # unknown never passes


def test_an_input_made_in_the_callers_code_names_that_code(runs):
    d, s, stdout = runs["rep_dropout"]
    lead = next(f for f in s["degrees"]["2"]["findings"] if "follows" not in f)
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"], lead["made_in"]) == (
        "forward", "norm", "in", "rank-inconsistent-replica", "model"), lead
    assert "at TP=2 forward: norm (in 0), computed in model's own forward code" in stdout, stdout
    assert run_cli("gate", str(d)).returncode == 4
