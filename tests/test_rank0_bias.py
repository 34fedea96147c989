"""vLLM's row-parallel bias, added by rank 0 only before the all-reduce
(tests/models/planted/rank0_bias.py), run as an engine runs it (forward only) and as a trainer does.

Main at e403778:
- forward only, a correct reordering ((x0 + b) + x1) that the float64 re-execution judged rounding
  read `unknown` ("not judged"): its ranks' op streams differ (addmm on rank 0, mm on rank 1), so no
  op-level rerun named the op. The module's own weights now name it (diff/generic_bound.py: `down`
  cut on its input dim - row-parallel-reduction).
- trained, rank 1 never gets a grad for the bias: the world failed "not SPMD" (exit 2, nothing named).
  The missing grad is now recorded as zeros on the ranks that lack it (runner/missing_grads.py): a BUG,
  rank-inconsistent-replica at the bias's grad.
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/rank0_bias.py:"


def _run(tmp_path, case, *more):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm", *more,
                "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode


def test_rank0_bias_in_an_engine_is_rounding(tmp_path):
    s, out, gate = _run(tmp_path, "rank0_bias", "--forward-only")
    fd = s["degrees"]["2"]["first_divergence"]
    assert (fd["module"], fd["kind"], fd["cause"]) == ("mlp", "out", "row-parallel-reduction"), fd
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert gate == 1 and "BUG" not in out, out[-1500:]


def test_rank0_bias_in_a_trainer_is_a_bug_at_its_grad(tmp_path):
    from tpdiag.diff.classes import leading_bug

    s, out, gate = _run(tmp_path, "rank0_bias")
    e = s["degrees"]["2"]
    assert e["status"] == "divergent", e
    lead = leading_bug(e)
    assert lead is not None and (lead["key"], lead["cause"]) == (
        "s0/backward/mlp/param_grad#0/bias", "rank-inconsistent-replica"), lead
    assert gate == 4


def test_bias_after_the_reduce_is_rounding(tmp_path):
    s, out, gate = _run(tmp_path, "bias_after")
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert gate == 1 and "BUG" not in out, out[-1500:]


def test_rank0_bias_under_hash_capture_leads_with_its_grad(tmp_path):
    # pass 1 (hashes) has no record of the bias grad (rank 1 has none), so it names the step's
    # params first; the region pass names the grad, which that finding follows. On top of
    # runner/missing_grads.py alone, each was made to follow the other: no lead, the summary read
    # 'rounding only' while `gate` exited 4.
    from tpdiag.diff.classes import leading_bug

    s, out, gate = _run(tmp_path, "rank0_bias", "--capture", "hash")
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["key"], lead["cause"]) == ("s0/backward/mlp/param_grad#0/bias", "rank-inconsistent-replica"), lead
    assert "rounding only" not in out and gate == 4, out[-1500:]


def test_findings_that_follow_each_other_are_both_roots():
    from tpdiag.diff.classes import degree_class, leading_bug, roots

    a = {"key": "a", "cause": "rank-inconsistent-replica", "follows": "b"}
    b = {"key": "b", "cause": "rank-inconsistent-replica", "follows": "a"}
    into = {"key": "c", "cause": "sharding-bug", "follows": "a"}
    entry = {"status": "divergent", "first_divergence": {"cause": "row-parallel-reduction"}, "findings": [a, b, into]}
    assert roots(entry["findings"]) == [a, b]
    assert degree_class(entry) == "bug" and leading_bug(entry) is a
    # a bug that follows the rounding first divergence, or a record that is no finding, is judged on its
    # own by the gate (exit 4): a root of its own, so the headline says BUG too (records/causes.groups_under)
    fd = {"key": "s0/forward/down/out#0/0", "cause": "row-parallel-reduction"}
    for follows in (fd["key"], "the first divergence"):
        d = {"key": "d", "cause": "sharding-bug", "follows": follows}
        fd_only = {**entry, "first_divergence": fd, "findings": [d]}
        assert degree_class(fd_only) == "bug" and leading_bug(fd_only) is d, follows
    # ... and a rounding finding under it is grouped
    r = {"key": "r", "cause": "row-parallel-reduction", "follows": fd["key"]}
    assert roots([r], fd) == [] and degree_class({**entry, "first_divergence": fd, "findings": [r]}) == "rounding"
