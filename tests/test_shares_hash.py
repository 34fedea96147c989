"""Per-rank shares of a sum under `--capture hash` (helper hbug14; tests/models/planted/shard_stats.py).

rms_ok is a CORRECT model: its FFN's row-parallel all-reduce is a module of its own (`ffn.sum_ranks`),
so that module's input is each rank's share of the sum it reduces. A full capture reads the shares
whole, finds they add up to the reference's value and leaves them uncompared (diff/partials.py): the
first divergence is the all-reduce, rounding. A hash-first pass cannot add hashes up: on main at
da9eec2 it read the input's differing hashes as "shares that do not add up" - `sharding-bug`, BUG,
gate 4 - and the region pass, which captured the module whole and saw the shares add up, did not
"reproduce this first divergence", so pass 1's verdict stood. The region pass's reading now replaces
it (runner/drill.py `_shares`; the gate and the integrity checks read summary.json's
`not_compared.shares`, held to the region pass's own: records/shares.py).

Its buggy twin rms_local (the norm's mean square over the rank's own columns: shares that do not add
up) stays BUG, gate 4, under hash capture too.
"""
import json
import shutil

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/shard_stats.py:"
IN_KEY = "s0/forward/ffn.sum_ranks/in#0/0"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("rms_ok", "rms_local"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--capture", "hash", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (d, json.loads((d / "summary.json").read_text()), p.stdout)
    return out


def test_shares_that_add_up_read_whole_are_rounding_under_hash_capture(runs):
    d, s, stdout = runs["rms_ok"]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and "BUG" not in stdout, (e["first_divergence"], e.get("findings"))
    fd = e["first_divergence"]
    assert (fd["module"], fd["kind"], fd["cause"]) == ("ffn.sum_ranks", "out", "row-parallel-reduction"), fd
    assert IN_KEY in e["not_compared"]["shares"], e.get("not_compared")
    assert not any(f.get("key") == IN_KEY for f in e.get("findings") or ()), e.get("findings")
    assert run_cli("gate", str(d)).returncode == 1
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_shares_that_do_not_add_up_stay_a_bug_under_hash_capture(runs):
    from tpdiag.diff.classes import leading_bug

    d, s, _ = runs["rms_local"]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead["cause"] == "sharding-bug", s["degrees"]["2"]["first_divergence"]
    assert not (s["degrees"]["2"].get("not_compared") or {}).get("shares")
    assert run_cli("gate", str(d)).returncode == 4


def test_shares_the_region_pass_did_not_read_are_an_edit(runs, tmp_path):
    """summary.json's shares list is held to the region pass's: listing the buggy twin's input there
    (and dropping its finding) must not turn its BUG into a pass."""
    src, s, _ = runs["rms_local"]
    d = tmp_path / "r"
    shutil.copytree(src, d)
    e = s["degrees"]["2"]
    e["not_compared"] = {**(e.get("not_compared") or {"records": 0, "ops": 0, "why": {}}), "shares": [IN_KEY]}
    e["findings"] = [f for f in e["findings"] if f.get("key") != IN_KEY]
    (d / "summary.json").write_text(json.dumps(s))
    p = run_cli("gate", str(d), "--allow", "rounding")
    assert p.returncode == 2, p.stdout[-2000:]


def test_the_confirmation_rerun_reads_the_shares_whole_too(tmp_path):
    """With the confirmation on (the default flow), its rerun is hash-captured as well: its first
    divergence was the shares again, read `sharding-bug` from hashes ("first divergence moves to
    forward: ffn.sum_ranks (in 0) ... (sharding-bug)"); a fix confirmed there would have filed it as a
    BUG (runner/confirm._bug_after). The rerun's region pass now reads them whole (confirm._judge_after)."""
    d = tmp_path / "r"
    p = run_cli("compare", "--model", SPEC + "rms_ok", "--tp", "1,2", "--no-baseline", "--capture", "hash",
                "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    e = s["degrees"]["2"]
    after = e["confirmation"]["first_divergence_after"]
    assert s["class"] == "rounding" and after["cause"] == "row-parallel-reduction", after
    assert run_cli("gate", str(d)).returncode == 1
