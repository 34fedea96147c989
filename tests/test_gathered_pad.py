"""A gathered (gather_output=True) LM head over a padded vocab whose ranks mask only their own range's
padding (tests/models/planted/gathered_pad.py): every rank returns the whole padded logits, the 31
real ones equal on every rank, the padding id's logit 0 on rank 0 and -inf on rank 1.

Main at e403778 (runner/logits.whole_vocab) took the ranks' logits for replicas only when ALL their
padded columns were equal: here it read them as vocab shards, so rank 0's columns became every rank's
logits and rank 1's logit grad was zero - the correct model read a false BUG (`sharding-bug` at the
head's weight grad). The replica test now compares the real ids' logits only.
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/gathered_pad.py:"


@pytest.mark.parametrize("case", ["own_range", "every_rank"])
def test_gathered_head_padding_is_no_token(case, tmp_path):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in p.stdout, p.stdout[-1500:]
    assert s["degrees"]["2"]["logprobs"]["bitwise"], s["degrees"]["2"]["logprobs"]
    assert run_cli("gate", str(d)).returncode == 1
