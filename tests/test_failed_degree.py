"""One degree's world failing (the user's code raises only at TP=4) must leave every degree that ran
judged as if the failed one had not been asked for - its second pass (float64 re-execution, each
module on its own inputs) and its confirmation rerun - while the failed degree is reported with its
reason and the run stays inconclusive: compare and gate exit 2, never a pass. Until 2026-12-02 the
second pass and the confirmation waited for the whole run to be `divergent`: TP=2 beside a failed TP=4
kept pass 1's verdict only, no float64 judgement, no confirmation."""
import json
import os

import pytest

from conftest import run_cli

MODEL = "py:tests/models/user_fails_at4.py:target"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("failed_degree")
    out = {}
    for name, tp, rc in (("with4", "1,2,4", 2), ("without4", "1,2", 0)):
        p = run_cli("compare", "--model", MODEL, "--tp", tp, "--out", str(root / name))
        # DESIGN.md: a world failed -> exit 2 (inconclusive); without it, a finished compare -> 0
        assert p.returncode == rc, p.stdout + p.stderr
        out[name] = (root / name, json.loads((root / name / "summary.json").read_text()), p.stdout)
    return out


def _as_run(entry: dict, run_dir) -> str:
    """The entry as JSON with its run directory's path taken out (the confirmation's and the second
    pass's folders name it)."""
    return json.dumps(entry, sort_keys=True).replace(str(run_dir), "RUN_DIR")


def test_failed_degree_is_reported_and_fails_the_gate(runs):
    run_dir, s, stdout = runs["with4"]
    assert s["status"] == "inconclusive"
    d4 = s["degrees"]["4"]
    assert d4["status"] == "failed", d4
    assert "my fused kernel has no 4-way split" in d4["error"], d4
    assert "TP=4 failed" in stdout, stdout
    g = run_cli("gate", str(run_dir), "--allow", "rounding")
    assert g.returncode == 2, g.stdout + g.stderr
    assert "TP=4: error: world failed" in g.stdout and "my fused kernel has no 4-way split" in g.stdout, g.stdout


def test_other_degree_is_judged_as_without_the_failed_one(runs):
    run_dir, s, _ = runs["with4"]
    alone_dir, alone, _ = runs["without4"]
    d2, a2 = s["degrees"]["2"], alone["degrees"]["2"]
    # the second pass ran for TP=2 (its folder and summary), and re-executed the first divergence in float64
    assert s.get("second_pass") and os.path.isfile(os.path.join(s["second_pass"]["dir"], "summary.json")), s
    assert d2["first_divergence"].get("oracle"), d2["first_divergence"]
    # ... and so did the confirmation: the row-parallel sum's fix makes TP=2 bitwise
    assert (d2.get("confirmation") or {}).get("verdict") == "confirmed", d2.get("confirmation")
    assert d2["class"] == "rounding"
    # every word of TP=2's verdict is what `--tp 1,2` alone gives (the worlds are deterministic)
    assert _as_run(d2, run_dir) == _as_run(a2, alone_dir)
    assert _as_run(s["second_pass"], run_dir) == _as_run(alone["second_pass"], alone_dir)


def test_fix_chain_goes_on_without_the_failed_degree(tmp_path):
    """`--fix auto`: round 0 fails TP=4; the fixed rounds run the degrees that ran, as `--tp 1,2` does."""
    chains = {}
    for name, tp, rc in (("with4", "1,2,4", 2), ("without4", "1,2", 0)):
        p = run_cli("compare", "--model", MODEL, "--tp", tp, "--fix", "auto", "--out", str(tmp_path / name))
        assert p.returncode == rc, p.stdout + p.stderr
        s = json.loads((tmp_path / name / "summary.json").read_text())
        chains[name] = (s, p.stdout)
    s, stdout = chains["with4"]
    alone, _ = chains["without4"]
    assert s["status"] == "inconclusive" and s["degrees"]["4"]["status"] == "failed", s["degrees"]["4"]
    chain = s["fix_chain"]
    # round 1 (tp-invariant-linear) at TP=1,2: bitwise, as in the chain of `--tp 1,2` alone
    assert [r["fixes"] for r in chain] == [r["fixes"] for r in alone["fix_chain"]] == [[], ["tp-invariant-linear"]]
    assert [r["status"] for r in chain[1:]] == [r["status"] for r in alone["fix_chain"][1:]] == ["bitwise"]
    assert chain[1]["first_divergence"] == {"2": None}
    assert chain[0]["status"] == "inconclusive" and chain[0]["left_out"] == ["4"], chain[0]
    assert "the next rounds leave out TP=4 (failed)" in stdout, stdout
    assert s["class"] == alone["class"] == "rounding" and s["status_after_fixes"] == "bitwise"
    g = run_cli("gate", str(tmp_path / "with4"), "--allow", "rounding")
    assert g.returncode == 2, g.stdout + g.stderr
