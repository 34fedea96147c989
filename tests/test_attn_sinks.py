"""gpt-oss-style attention sinks split by heads (tests/models/planted/attn_sinks.py, helper
hplant17): the sinks of the first heads used on every rank (a forward bug), the sinks' grads never
summed over the ranks (a replica bug), and the twin. At TP=4 each rank holds one head and,
where the host's GEMM rounds a one-head column shard otherwise (AMD EPYC), the first divergence is a
q projection's rounding (elsewhere the attention itself, on bitwise inputs); the attention, judged on its own inputs in float64,
is far - but its softmax is stabilised with `x - x.max(-1).values` over masked scores, and that max
was noted a discrete choice, so the far verdict was dropped and sinks_first read `rounding only`
(gate 0 with --allow rounding) on main. A max whose indices nothing reads chooses nothing."""
import json

import pytest

from conftest import colwise_shard_rounds_otherwise, planted_run, run_cli

CASES = {"sinks_first": ("--tp", "1,4"), "sinks_unsynced": ("--tp", "1,2"), "sinks_ok": ("--tp", "1,2,4")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, more in CASES.items():
        d, p = planted_run(tmp_path_factory, "attn_sinks", case, *more)
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout,
                     run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


def test_the_first_heads_sinks_on_every_rank_is_a_bug_at_the_attention(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["sinks_first"]
    lead = leading_bug(s["degrees"]["4"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["4"]
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "layers.0.self_attn", "sharding-bug"), lead
    assert lead["bound_ratio"] > 1e3 and "discrete" not in lead.get("oracle", {}), lead
    fd = s["degrees"]["4"]["first_divergence"]
    # q_proj [16, 32] @ [32, 32].T cut to each rank's 8 columns: its K-sum is whole, so whether it
    # rounds otherwise is the host's kernel choice (AMD EPYC: yes; Intel AVX-512/AMX: bitwise)
    if colwise_shard_rounds_otherwise(2 * 8, 32, 32, 8):  # attn_sinks.py: BATCH x SEQ rows, HIDDEN 32
        # the first divergence before it stays the q projection's rounding: the attention is
        # judged on its own (differing) inputs, and still far
        assert (fd["module"], fd["cause"]) == ("layers.0.self_attn.q_proj", "shape-dependent-gemm"), fd
    else:
        # the projections bitwise: the attention, on bitwise inputs, is itself the first divergence
        assert (fd["phase"], fd["module"], fd["cause"]) == ("forward", "layers.0.self_attn", "sharding-bug"), fd
        assert fd["bound_ratio"] > 1e3 and "discrete" not in fd.get("oracle", {}), fd
    assert "BUG (a wrong result, not rounding) at TP=4 forward: layers.0.self_attn" in stdout and gate == 4, stdout


def test_unsummed_sink_grads_are_a_rank_inconsistent_replica(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["sinks_unsynced"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["name"], lead["cause"]) == \
        ("backward", "layers.0.self_attn", "param_grad", "sinks", "rank-inconsistent-replica"), lead
    assert gate == 4, stdout


def test_the_twin_is_rounding_at_every_degree(runs):
    s, stdout, gate = runs["sinks_ok"]
    assert s["class"] == "rounding", s
    assert all(not e.get("findings") for e in s["degrees"].values()), s["degrees"]
    assert "BUG" not in stdout and gate == 0, stdout
