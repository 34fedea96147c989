"""Megatron's sequence parallelism written by hand (tests/models/planted/seq_parallel.py), run as a
user runs it: `tpdiag compare py:... --tp 1,2`, then `tpdiag gate`.

- sp_gather_split: the column layer's sequence all-gather with a backward that takes this rank's
  slice of its own partial input grad instead of reduce-scattering the ranks' partials. Forward
  exact; the norm's input grad (and so the norm's weight grad and the embedding's) misses the
  other rank's columns, 1.4e-2 off where rounding moves 1e-9. Main at f0a5d0e read `rounding
  only` (gate 1): that grad is read by `mlp` and by the `mlp.up` it hands its input to, two
  consumers, so no consumer's float64 backward judged it (only one consumer was). The outer
  consumer's backward computes the whole grad: records/keys.sole_consumer.
- sp_pos_local: learned positions added to each rank's sequence slice numbered from 0: BUG at the
  positions' input, computed in the model's own forward code (it read `forward: model (in 0)`,
  as if the model's own input, the tokens, differed).
- sp_pos_ok: the twin of both (positions offset by the rank's start, the grad reduce-scattered).
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/seq_parallel.py:"
CASES = ("sp_gather_split", "sp_pos_local", "sp_pos_ok")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


def _lead(s):
    from tpdiag.diff.classes import leading_bug

    return leading_bug(s["degrees"]["2"])


def test_the_twin_is_rounding_only(runs):
    s, stdout, gate = runs["sp_pos_ok"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])


def test_a_gather_that_splits_its_grad_is_a_bug_at_the_grad_it_returned(runs):
    s, stdout, gate = runs["sp_gather_split"]
    lead = _lead(s)
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"].get("findings")
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "backward", "norm", "grad_out", "sharding-bug"), lead
    assert lead["consumers"] == ["mlp", "mlp.up"], lead
    assert lead["bound_ratio"] > 1e4, lead  # far: the other rank's columns are missing
    assert "BUG (a wrong result, not rounding) at TP=2 backward: norm (grad_out 0), returned by the backward " \
           "of mlp, mlp.up" in stdout, stdout
    assert gate == 4


def test_positions_not_offset_by_the_ranks_start_are_a_bug_in_the_models_code(runs):
    s, stdout, gate = runs["sp_pos_local"]
    fd = s["degrees"]["2"]["first_divergence"]
    assert (fd["phase"], fd["module"], fd["kind"], fd["cause"]) == ("forward", "model", "in", "sharding-bug"), fd
    assert fd["key"] == "s0/forward/wpe/in#0/0", fd
    assert "BUG (a wrong result, not rounding) at TP=2 forward: wpe (in 0), computed in model's own forward " \
           "code" in stdout, stdout
    assert "forward: model (in 0)" not in stdout
    assert gate == 4
    from tpdiag.reports.words import where  # the report's verdict read "at the input of model"

    assert where(fd) == "the input of wpe, computed in model's own forward code in the forward pass of step 0"


def test_the_one_consumer_of_a_grad_is_the_outermost():
    from tpdiag.records.keys import sole_consumer

    assert sole_consumer(["mlp", "mlp.up"]) == "mlp"
    assert sole_consumer(["mlp.up", "mlp", "mlp.up.inner"]) == "mlp"
    assert sole_consumer(["head"]) == "head"
    # two modules that each read it: neither one's backward is the whole grad
    assert sole_consumer(["attn", "mlp"]) is None
    assert sole_consumer(["mlp", "mlp2.up"]) is None  # a shared prefix is no parent
    assert sole_consumer([]) is None and sole_consumer(None) is None
