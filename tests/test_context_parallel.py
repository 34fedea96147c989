"""Context parallelism by hand with SDPA (tests/models/planted/context_parallel.py, helper hred14):
each rank's queries against every position's all-gathered keys/values. `is_causal=True` with fewer
queries than keys is top-left aligned - rank 1's queries see the wrong keys: BUG in attn at TP=2. The
twin's explicit offset mask reads rounding. The op pass names the attention op: on the old code it
named the v all-gather before it (a TP-only collective whose gathered result is bitwise the
reference's `wv` output: diff/reassembled.py), and its `attn.wq :: aten::mm` a false second finding
(the GEMM's flattened sequence-shard rows gathered along dim 0: diff/flat_rows.py)."""
import pytest

from conftest import compare_planted

CASES = {c: ("context_parallel", c, ("--tp", "1,2")) for c in ("cp_is_causal", "cp_offset")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_top_left_causal_mask_on_a_query_slice_is_a_bug_in_the_attention(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["cp_is_causal"]
    assert s["class"] == "bug" and gate == 4, s["degrees"]["2"]
    lead = leading_bug(s["degrees"]["2"])
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "attn", "sharding-bug"), lead
    assert lead["op"] == "aten::_scaled_dot_product_flash_attention_for_cpu", lead
    # the projections' GEMMs on the rank's own positions are right: their aten::mm output [B*S/2, D]
    # is the sequence shard's rows flattened, put back as the module's [B, S/2, D] is
    # (diff/flat_rows.py); gathered along dim 0 it read a false sharding-bug at attn.wq (hred15)
    ops = [f["key"] for f in s["degrees"]["2"].get("findings") or [] if "/op#" in f["key"]]
    assert not [k for k in ops if "/attn.w" in k], ops


def test_the_offset_mask_is_rounding(runs):
    s, stdout, gate = runs["cp_offset"]
    assert s["class"] == "rounding" and gate == 1, s["degrees"]["2"]
    assert not s["degrees"]["2"].get("findings"), s["degrees"]["2"].get("findings")
    assert "BUG" not in stdout
