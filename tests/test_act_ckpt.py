"""Activation checkpointing (tests/models/planted/act_ckpt.py): a TP MLP under
torch.utils.checkpoint(use_reentrant=True), run as a user runs it (`tpdiag compare py:... --tp 1,2`,
the defaults but the baseline, then `tpdiag gate`).

Main at 0428e29 read every such model `not judged`, gate 2 - the correct ones and the mistake alike:
the block's forward runs again during backward (the recompute), and the own-input pass's reference
re-executed its float64 backward at both calls, writing each `grad_in.0.c0@2` record twice ("listed
twice": the second pass failed). The recompute's call leaves that to the forward call now
(probes/module_probe.py)."""
import json

import pytest

from conftest import run_cli

CASES = ("ckpt_ok", "ckpt_bias", "ckpt_bias_ok")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/act_ckpt.py:{case}", "--tp", "1,2",
                    "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        g = run_cli("gate", str(d))
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, g.returncode)
    return out


@pytest.mark.parametrize("case", ["ckpt_ok", "ckpt_bias_ok"])
def test_a_correct_checkpointed_mlp_is_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d.get("findings"), (case, d)
    assert d["first_divergence"]["cause"] == "row-parallel-reduction", d["first_divergence"]
    assert "inconclusive" not in stdout and gate == 1, (case, gate, stdout[-2000:])


def test_the_bias_added_on_every_rank_inside_the_checkpoint_is_a_bug(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["ckpt_bias"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "mlp", "sharding-bug"), lead
    assert "BUG (a wrong result, not rounding) at TP=2 forward: mlp" in stdout, stdout
    assert gate == 4
