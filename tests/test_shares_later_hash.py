"""Each rank's share of one value PAST the first divergence, under `--capture hash` (helper hhash18).

tests/models/planted/moe_bwd_bug.py:shared_beside is a CORRECT model: a row-parallel MLP (its all-reduce
the first divergence, rounding) before a top-2 MoE whose experts each rank runs on its own tokens, so the
router's output grad on each rank is that rank's share of the sum the backward makes. A full capture
reads the copies whole, finds they add up to the reference's and lists the record "not compared"
(summary.json not_compared.shares). A hash-first pass sees only that the ranks' hashes differ: on main
at 98f681f it read `rank-inconsistent-replica` - BUG, `gate --allow rounding` exit 4 - while its region
pass, which read the record whole as shares, only replaced a first divergence that was itself a share
(runner/drill_merge._shares). moe_late_bug.py:shared_once read the same. Under --no-judge-downstream the region pass did not even capture the
router (runner/drill.py now reads the modules of such hash findings whole), and the honest run gated
INCONCLUSIVE, exit 2 (records/integrity.py: the own-input pass that never runs there was "missing").

The negative control: behind.py:bugs under hash capture (conftest's behind_hash_run), whose
sequence-parallel norm's weight grad is never all-reduced (its replicas part at the step), stays
`rank-inconsistent-replica`, BUG, gate 4; listing it as a share in summary.json is an edit (exit 2).
"""
import json
import shutil

import pytest

from conftest import run_cli

PLANTED = "py:tests/models/planted/"
ROUTER = "s0/backward/sparse.router/grad_out#0/0"
NORM = "s0/backward/norm/param_grad#0/weight"
# (model, its router's output grad, more flags): with the own-input judgement on, the region pass
# captures the router anyway (moe_late_bug.py's twin; runner/drill_merge._later_shares is the fix);
# without it, only because pass 1 read that record rank-inconsistent (runner/drill.py: replicas)
CASES = {"beside-no-judge": ("moe_bwd_bug.py:shared_beside", ROUTER, ("--no-judge-downstream",)),
         "once": ("moe_late_bug.py:shared_once", "s0/backward/moe.router/grad_out#0/0", ())}


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    out = {}
    for case, (model, key, more) in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", PLANTED + model, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--capture", "hash", *more, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (d, json.loads((d / "summary.json").read_text()), p.stdout, key)
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_share_past_the_first_divergence_is_not_compared_under_hash_capture(twins, case):
    d, s, stdout, ROUTER = twins[case]
    e = s["degrees"]["2"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    # the region pass read the router's output grad whole: each rank's share of one value
    region = json.loads((d / "region" / "summary.json").read_text())["degrees"]["2"]
    assert ROUTER in region["not_compared"]["shares"], region.get("not_compared")
    assert ROUTER in e["not_compared"]["shares"], e.get("not_compared")
    assert not any(f.get("key") == ROUTER for f in e.get("findings") or ()), e.get("findings")
    assert s["class"] == "rounding" and "BUG" not in stdout, (e.get("findings"), stdout[-1500:])
    assert run_cli("gate", str(d)).returncode == 1
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 0, g.stdout + g.stderr


def test_judge_downstream_off_in_the_runs_manifest_alone_is_an_edit(twins, tmp_path):
    """No own-input pass under --no-judge-downstream (records/integrity.py believes it where the run's and
    its region pass's manifests both say so): a judged run's region/ops/ deleted and its manifest alone
    edited to judge_downstream false stays INCONCLUSIVE."""
    src = twins["once"][0]
    assert (src / "region" / "ops" / "summary.json").is_file()
    d = tmp_path / "r"
    shutil.copytree(src, d)
    shutil.rmtree(d / "region" / "ops")
    m = json.loads((d / "manifest.json").read_text())
    assert m["config"]["judge_downstream"] is True
    m["config"]["judge_downstream"] = False
    (d / "manifest.json").write_text(json.dumps(m))
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 2 and "region/ops/" in g.stdout + g.stderr, g.stdout[-2000:] + g.stderr[-2000:]


def test_a_replica_whose_ranks_disagree_past_the_first_divergence_stays_a_bug(behind_hash_run):
    s = json.loads((behind_hash_run / "summary.json").read_text())
    e = s["degrees"]["2"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    got = [f for f in e["findings"] if f.get("key") == NORM]
    assert len(got) == 1 and got[0]["cause"] == "rank-inconsistent-replica" and "follows" not in got[0], got
    assert NORM not in ((e.get("not_compared") or {}).get("shares") or ()), e.get("not_compared")
    assert s["class"] == "bug"
    g = run_cli("gate", str(behind_hash_run), "--allow", "rounding")
    assert g.returncode == 4 and "rank-inconsistent-replica" in g.stdout, g.stdout + g.stderr


def test_a_disagreeing_replica_listed_as_a_share_is_an_edit(behind_hash_run, tmp_path):
    d = tmp_path / "r"
    shutil.copytree(behind_hash_run, d)
    s = json.loads((d / "summary.json").read_text())
    e = s["degrees"]["2"]
    e["not_compared"] = {**(e.get("not_compared") or {"records": 0, "ops": 0, "why": {}}), "shares": [NORM]}
    e["findings"] = [f for f in e["findings"] if f.get("key") != NORM]
    for f in e["findings"]:
        if f.get("follows") == NORM:
            del f["follows"]
    (d / "summary.json").write_text(json.dumps(s))
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 2, g.stdout[-2000:] + g.stderr[-2000:]


def test_a_later_share_leaves_pass_1s_finding_and_is_listed():
    """The copy-back itself (runner/drill_merge._later_shares): pass 1's finding on a record the region
    pass read as shares goes and the record is listed not compared; a finding that followed it is judged
    on its own again (fail closed); a finding on a record the region pass did not read as shares stays."""
    from tpdiag.runner.drill_merge import _later_shares

    entry = {"findings": [{"key": ROUTER, "cause": "rank-inconsistent-replica"},
                          {"key": "b", "cause": "sharding-bug", "follows": ROUTER},
                          {"key": NORM, "cause": "rank-inconsistent-replica"}]}
    _later_shares(entry, {"not_compared": {"shares": [ROUTER]}})
    assert entry["findings"] == [{"key": "b", "cause": "sharding-bug"},
                                 {"key": NORM, "cause": "rank-inconsistent-replica"}], entry["findings"]
    assert entry["not_compared"]["shares"] == [ROUTER] and entry["not_compared"]["module_records"] == [ROUTER]
    kept = {"findings": [{"key": NORM, "cause": "rank-inconsistent-replica"}]}
    _later_shares(kept, {"not_compared": {"records": 1, "why": {"only at this degree": 1}}})
    assert kept == {"findings": [{"key": NORM, "cause": "rank-inconsistent-replica"}]}, kept
