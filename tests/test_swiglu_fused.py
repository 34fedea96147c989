"""A fused SwiGLU gate/up projection split by a ColwiseParallel plan (tests/models/planted/
swiglu_fused.py): `chunk(2, -1)` of the LOCAL shard pairs halves of gate (rank 0) or of up (rank 1)
- right at TP=1 only: BUG at the MLP's first op on the split, gate 4; the twin with interleaved
rows (`0::2` / `1::2`) rounding, gate 1. Read right when written (helper hbug12)."""
import pytest

from conftest import compare_planted

CASES = {c: ("swiglu_fused", c, ("--tp", "1,2")) for c in ("swiglu_chunk", "swiglu_interleave")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_chunk_of_the_local_shard_is_a_bug_at_the_mlp(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["swiglu_chunk"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "mlp", "sharding-bug"), lead
    assert lead["bound_ratio"] > 1e4, lead
    assert "BUG (a wrong result, not rounding) at TP=2 forward: mlp" in stdout and gate == 4, stdout


def test_interleaved_rows_are_rounding(runs):
    s, stdout, gate = runs["swiglu_interleave"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1
