"""An RL trainer's own loss terms, run as a user runs them (`tpdiag compare py:... --tp 1,2
--no-baseline --no-confirm`, then `tpdiag gate`): a k3 KL penalty to a frozen vocab-parallel
reference head whose logprob takes its shard's own normaliser (tests/models/planted/rl_kl.py), and
a GRPO loss over a sequence-parallel LM's own positions whose response mask counts the rank's
LOCAL positions from 0 (tests/models/planted/rl_sp_mask.py), beside their twins. Main at 00909fb
reads them as these tests hold (float32): each mistake BUG at the loss, each twin rounding only."""
import json

import pytest

from conftest import run_cli

CASES = {"kl_ref_local": "rl_kl", "kl_ok": "rl_kl", "mask_local_pos": "rl_sp_mask", "seqmean_ok": "rl_sp_mask"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, file in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/{file}.py:{case}", "--tp", "1,2",
                    "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


@pytest.mark.parametrize("case", ["kl_ok", "seqmean_ok"])
def test_the_twins_are_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])


@pytest.mark.parametrize("case", ["kl_ref_local", "mask_local_pos"])
def test_the_mistake_is_a_bug_at_the_loss(runs, case):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["kind"], lead["cause"]) == ("loss", "loss", "sharding-bug"), lead
    assert lead["bound_ratio"] > 100, lead
    assert "BUG (a wrong result, not rounding) at TP=2 loss" in stdout and gate == 4
