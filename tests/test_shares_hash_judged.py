"""A share grad read BUG from hashes alone, judged from whole values by the region pass, under
`--capture hash` (runner/drill_merge._judged_whole; helper hhash20).

A hash-first pass 1 sees only that the ranks' hashes of an activation grad differ: it reads
`rank-inconsistent-replica` (BUG). Its region pass captures that module whole and reads the ranks'
copies as each rank's share of a sum the backward reduces later - within the bf16 share band
(diff/partials.near_shares: moe_bwd_bug.py:shared_beside), or on the token rows a router flip left alone
(diff/flip_shares.py: moe_zloss_flip.py) - and judges it `unknown`, as a full capture does. On main at
9e2243de the merge kept pass 1's hash-only BUG on a record both passes found: the CORRECT `zloss_share`
and `shared_beside` read BUG, gate 4, under --capture hash only (full capture: unknown, gate 1;
tests/test_flip_shares.py, test_shares_near.py). Now the region's verdict, the same evidence judged
better, replaces it: all three read what full capture reads - `unknown`, gate 1 (the bug twin
`zloss_every_rank` too: its error sits inside the band, not told from a correct split).

The negative controls: moe_late_bug.py:shared_every_rank in bf16 under hash, whose router grad's
shares miss even the band, stays `rank-inconsistent-replica`, BUG, gate 4; and a pass-1 BUG relabelled
so in summary.json while the region pass judged it a bug is an edit (gate exit 2).
"""
import json

import pytest

from conftest import copied_run, planted_shared, run_cli

HASH = ("--tp", "1,2", "--dtype", "bfloat16", "--capture", "hash")
# (planted file, model): the record pass 1 read BUG from hashes alone
CASES = {"zloss_share": ("moe_zloss_flip", "s0/backward/moe.router.proj/grad_out#0/0"),
         "zloss_every_rank": ("moe_zloss_flip", "s0/backward/moe.router.proj/grad_out#0/0"),
         "shared_beside": ("moe_bwd_bug", "s0/backward/sparse.router/grad_out#0/0")}
BUG = ("moe_late_bug", "shared_every_rank", "s0/backward/moe.router/grad_out#0/0")
# the share rule each region verdict comes of (diff/judge.py): on the rows a router flip left alone, or
# near the reference within the share band
RULES = {"zloss_share": "flip-shares", "zloss_every_rank": "flip-shares", "shared_beside": "near-shares"}


def _run(tmp_path_factory, f, func):
    d, stdout = planted_shared(tmp_path_factory, f, func, *HASH)
    return d, json.loads((d / "summary.json").read_text()), stdout, run_cli("gate", str(d)).returncode


@pytest.mark.parametrize("func", CASES)
def test_a_share_grad_read_bug_from_hashes_takes_the_region_passs_verdict(tmp_path_factory, func):
    f, key = CASES[func]
    d, s, stdout, gate = _run(tmp_path_factory, f, func)
    e = s["degrees"]["2"]
    found = {g["key"]: g for g in e["findings"]}
    region = {g["key"]: g for g in json.loads((d / "region" / "summary.json").read_text())["degrees"]["2"]["findings"]}
    assert region[key]["cause"] == "unknown", region[key]  # the region pass read the ranks' copies whole
    g = found[key]
    assert g["cause"] == "unknown" and g["from"] == "second pass", g  # was rank-inconsistent-replica (BUG)
    assert g["why"] == region[key]["why"] and g["max_abs"] == region[key]["max_abs"] is not None, (g, region[key])
    # told by the region verdict's structured rule name, not its reason's words (records/share_rules.py)
    assert g["rule"] == region[key]["rule"] == RULES[func], (g, region[key])
    assert not any(h.get("cause") == "rank-inconsistent-replica" for h in e["findings"]), e["findings"]
    assert s["class"] == "unknown" and "BUG" not in stdout, stdout[-2000:]
    assert gate == 1  # not judged: the gate fails it, as under full capture


def test_a_replica_whose_shares_miss_the_band_stays_a_bug_under_hash(tmp_path_factory, tmp_path):
    f, func, key = BUG
    d, s, stdout, gate = _run(tmp_path_factory, f, func)
    found = {g["key"]: g for g in s["degrees"]["2"]["findings"]}
    assert found[key]["cause"] == "rank-inconsistent-replica" and "from" not in found[key], found[key]
    assert s["class"] == "bug" and gate == 4, (s["class"], gate)
    # pass 1's BUG relabelled as a region verdict in summary.json alone: the region pass judged it a bug
    run = copied_run(d, tmp_path)
    t = json.loads((run / "summary.json").read_text())
    for g in t["degrees"]["2"]["findings"]:
        if g["key"] == key:
            g.update(cause="unknown", why="the ranks' copies add up to the reference's value to within 1e-05",
                     max_abs=0.01, **{"from": "second pass"})
    (run / "summary.json").write_text(json.dumps(t))
    p = run_cli("gate", str(run))
    assert p.returncode == 2 and "judged it 'rank-inconsistent-replica'" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.parametrize("edit", ["dropped", "another"])
def test_a_replacement_without_the_region_passs_share_rule_fails_closed(tmp_path_factory, tmp_path, edit):
    """The gate holds a region verdict that replaced pass 1's per-rank-hash BUG to the share rule that
    made it (records/share_rules.py): dropped - as in a run written before the rule was kept - or
    named another than the region pass's own, the run is no evidence (exit 2), not the pass it was."""
    f, key = CASES["shared_beside"]
    d, s, _, gate = _run(tmp_path_factory, f, "shared_beside")
    assert gate == 1
    run = copied_run(d, tmp_path)
    t = json.loads((run / "summary.json").read_text())
    g = next(g for g in t["degrees"]["2"]["findings"] if g["key"] == key)
    if edit == "dropped":
        del g["rule"]
    else:
        g["rule"] = "drifted-shares"
    (run / "summary.json").write_text(json.dumps(t))
    p = run_cli("gate", str(run))
    assert p.returncode == 2 and key in p.stdout and "rule" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]

