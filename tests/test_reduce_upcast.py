"""A bug that bites in bfloat16 only (tests/models/planted/reduce_upcast.py): a hand-written
row-parallel all-reduce `dist.all_reduce(t.float())` sums into `.float()`'s copy when t is bf16
and drops it. `--dtype bfloat16`: BUG at the MLP, its ranks disagree; the same model in float32
(`.float()` is t itself) and the twin in bf16: rounding. Read right when written (helper hbug12)."""
import pytest

from conftest import compare_planted

CASES = {"bf16": ("reduce_upcast", "reduce_upcast", ("--tp", "1,2", "--dtype", "bfloat16")),
         "fp32": ("reduce_upcast", "reduce_upcast", ("--tp", "1,2")),
         "ok_bf16": ("reduce_upcast", "reduce_upcast_ok", ("--tp", "1,2", "--dtype", "bfloat16"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_a_reduce_into_a_dropped_copy_is_a_bug_in_bf16(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["bf16"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "forward", "mlp", "out", "rank-inconsistent-replica"), lead
    assert "BUG (a wrong result, not rounding) at TP=2 forward: mlp" in stdout and gate == 4, stdout


@pytest.mark.parametrize("case", ["fp32", "ok_bf16"])
def test_the_same_code_in_float32_and_the_twin_are_rounding(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), (case, s["degrees"]["2"])
    assert "BUG" not in stdout and gate == 1
