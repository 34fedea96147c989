"""A Mamba2-style block split by hand (tests/models/planted/mamba_norm.py, helper hplant17): a gated
RMSNorm over groups that cuts its input by the group COUNT (right at TP=1, half-groups at TP=2) is a
BUG at the norm at every degree; the twin, cut by the group SIZE, is rounding. At TP=4, where the host's GEMM
rounds a quarter-width column shard otherwise (AMD EPYC; Intel AVX-512/AMX hosts give its bits, and
the norm is itself the first divergence), the first divergence is the mixer's own in-projection (its GEMM rounds otherwise at a quarter of the rows):
its op is near float64, but the mixer re-executed whole is far - through the norm it calls after,
which its own float64 re-execution finds far. On main that first divergence read `sharding-bug` at
`mixer :: aten::mm` (0.11x of rounding), and led the verdict in the norm's place."""
import json

import pytest

from conftest import colwise_shard_rounds_otherwise, planted_run, run_cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("groups_by_count", "groups_by_size"):
        d, p = planted_run(tmp_path_factory, "mamba_norm", case, "--tp", "1,2,4")
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout,
                     run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


@pytest.mark.parametrize("degree", ["2", "4"])
def test_groups_cut_by_count_is_a_bug_at_the_norm(runs, degree):
    from tpdiag.diff.classes import cause_class, leading_bug

    s, stdout, gate = runs["groups_by_count"]
    e = s["degrees"][degree]
    lead = leading_bug(e)
    assert e["class"] == "bug" and lead is not None, e
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "mixer.norm", "sharding-bug"), lead
    assert lead["bound_ratio"] > 1e3, lead
    # what diverged before it is rounding, named as such
    assert cause_class(e["first_divergence"]["cause"]) == "rounding" or e["first_divergence"] is lead, e["first_divergence"]
    assert f"{degree}   BUG     forward: mixer.norm" in stdout and gate == 4, stdout


def test_the_in_projection_before_it_reads_rounding_at_tp4(runs):
    s, stdout, _ = runs["groups_by_count"]
    from tpdiag.diff.classes import leading_bug

    fd = s["degrees"]["4"]["first_divergence"]
    # the in-projection [16, 16] @ [32, 16].T cut to each rank's 8 columns: its K-sum is whole, so
    # whether it rounds otherwise is the host's kernel choice (AMD EPYC: yes; Intel AVX-512/AMX: bitwise)
    if colwise_shard_rounds_otherwise(2 * 8, 16, 32, 8):  # mamba_norm.py: BATCH x SEQ rows, DIM 16, D_INNER 32
        assert (fd["module"], fd["op"], fd["cause"]) == ("mixer", "aten::mm", "shape-dependent-gemm"), fd
        assert not fd["op_oracle"]["far"], fd
        assert "TP=4: first divergence (before the bug, shape-dependent-gemm): forward: mixer :: aten::mm" in stdout, stdout
    else:
        # the projections bitwise: nothing rounds before the norm, which is itself the first
        # divergence and the bug - no rounding is named before it
        lead = leading_bug(s["degrees"]["4"])
        assert (fd["phase"], fd["module"], fd["cause"]) == ("forward", "mixer.norm", "sharding-bug") and fd == lead, fd
        assert "TP=4: first divergence (before the bug" not in stdout, stdout


def test_groups_cut_by_size_is_rounding(runs):
    s, stdout, gate = runs["groups_by_size"]
    assert s["class"] == "rounding", s
    assert all(not e.get("findings") for e in s["degrees"].values()), s["degrees"]
    assert "BUG" not in stdout and gate == 0, stdout
