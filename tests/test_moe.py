"""MoE: a router flip caused by an upstream rounding difference is named router-flip and pointed
at its root (a planted near-tie behind a row-parallel reduction, real 2-rank gloo worlds), with
negative controls: the same model under tp-invariant-linear (no reordered sum, no flip), and a
wide router margin (the same reordered sum, no flip)."""
import json

import pytest

from conftest import run_cli

MODEL = "py:tests/models/moe_flip.py"


def _compare(base, func, *extra, name=None):
    # each run its own folder: a second compare into the flip's folder left the flip's second pass
    # (ops/) beside a summary that names none, which the gate rightly reads as an edited run
    out = base / (name or func) / "run"
    p = run_cli("compare", "--model", f"{MODEL}:{func}", "--tp", "1,2", "--out", str(out),
                "--no-confirm", "--no-baseline", "--format", "json", *extra)
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads((out / "summary.json").read_text())["degrees"]["2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    return {"flip": _compare(base, "target"),
            "fixed": _compare(base, "target", "--fix", "tp-invariant-linear", name="target-fixed"),
            "wide": _compare(base, "target_wide"), "dir": base / "target" / "run"}


def test_router_flip_points_at_its_root(runs):
    d = runs["flip"]
    fd = d["first_divergence"]
    assert (fd["module"], fd["cause"], fd["root_cause"]) == ("down", "row-parallel-reduction", True)
    flips = [f for f in d["findings"] if f["cause"] == "router-flip"]
    assert len(flips) == 1, d["findings"]
    f = flips[0]
    assert f["module"] == "router" and f["root_cause"] is False and f["top_k"] == 2
    assert f["root"] == {"key": fd["key"], "module": "down", "cause": "row-parallel-reduction"}
    assert f["n_tokens"] == 1 and len(f["experts"]) == 1
    e = f["experts"][0]
    assert e["token"] == f["tokens"][0] and {0, 1} == set(e["reference"]) ^ set(e["this"])
    # the reference's 2nd/3rd score gap is a rounding-sized near-tie, and the scores did move
    assert 0 < f["margin"] < 1e-6 and e["scores_bitwise"] is False
    # the flip matters: the token ran another expert (far beyond the 1e-7 rounding of the rest)
    assert d["logprobs"]["max_abs"] > 1e-3


def test_a_real_flip_passes_the_gate_as_rounding(runs):
    """The gate checks a router-flip label against diff.csv's expert choices (records/labels.py): the
    run's own flip, an assignment that differs before it, is accepted (tests/test_tamper_labels.py: one
    written onto a bug's findings is not)."""
    p = run_cli("gate", str(runs["dir"]), "--allow", "rounding")
    assert p.returncode == 0, p.stdout + p.stderr


def test_no_flip_without_the_reordered_sum(runs):
    d = runs["fixed"]
    assert d["status"] == "bitwise" and d["findings"] == [] and d["logprobs"]["bitwise"]


def test_no_flip_with_a_wide_margin(runs):
    d = runs["wide"]
    assert d["first_divergence"]["cause"] == "row-parallel-reduction"
    assert d["findings"] == [] and d["logprobs"]["max_abs"] < 1e-5


def test_findings_after_a_flip_inherit_it():
    from tpdiag.diff.router import relabel_after

    flip = {"cause": "router-flip", "idx": 10, "key": "s0/forward/router/out#0/2"}
    findings = [{"cause": "sharding-bug"}, {"cause": "sharding-bug"},
                {"cause": "rank-inconsistent-replica"}]
    relabel_after(findings, [5, 12, 13], [flip])
    assert findings[0] == {"cause": "sharding-bug"}  # before the flip: its own finding
    assert findings[1] == {"cause": "router-flip", "root_cause": False, "after": flip["key"]}
    assert findings[2]["cause"] == "rank-inconsistent-replica"  # not a size judgement: kept
