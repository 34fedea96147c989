"""A plan that splits a weight tie is a BUG at the tied weight's grad (tpdiag/models/ties.py).

tests/models/planted/tied_split.py: bug() shards the tied embedding and head (two parameters at
TP=2, trained apart); before the check, the default compare read `rounding only` and "nothing is
wrong" - the tied grad is a sum over modules, so neither a layout bound nor the own-input
re-execution judged it. twin() keeps the tie: rounding only.
"""
import json

import pytest
import torch
from torch import nn

from conftest import run_cli

SPEC = "py:tests/models/planted/tied_split.py:"


def test_tie_groups_and_broken_ties():
    from tpdiag.models.ties import broken_ties, tie_groups

    m = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    assert tie_groups(m) == []
    m[1].weight = m[0].weight
    groups = tie_groups(m)
    assert groups == [("0.weight", "1.weight")]
    assert broken_ties(m, groups) == []
    m[1].weight = nn.Parameter(m[0].weight.detach().clone())  # what a style's distribute does
    assert broken_ties(m, groups) == [["0.weight", "1.weight"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """case -> (run directory, its summary, what compare printed). The bug's compare prints its
    text (what a user reads) and its summary is the one it wrote; the twin's prints JSON."""
    out = {}
    for case in ("bug", "twin"):
        d = tmp_path_factory.mktemp(case) / "r"
        fmt = ("--format", "json") if case == "twin" else ()
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    *fmt, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (d, json.loads(p.stdout if fmt else (d / "summary.json").read_text()), p.stdout)
    return out


def test_a_split_tie_is_a_bug_at_the_tied_grad(runs):
    d, s, text = runs["bug"]
    assert s["class"] == "bug", s["class"]
    f = s["degrees"]["2"]["findings"][0]
    assert (f["phase"], f["module"], f["kind"], f["name"], f["cause"]) == (
        "backward", "emb", "param_grad", "weight", "sharding-bug"), f
    assert "emb.weight = head.weight" in f["detail"], f
    w = json.loads((d / "tp2" / "world.json").read_text())
    assert w["ties_broken"] == [["emb.weight", "head.weight"]]
    assert "ties_broken" not in w["timings"]  # a fact of the sharded model, not a timing
    g = run_cli("gate", str(d))
    assert g.returncode == 4, g.stdout + g.stderr
    assert "split the weight tie emb.weight = head.weight" in text, text


def test_a_kept_tie_is_rounding(runs):
    d, s, _ = runs["twin"]
    assert s["class"] != "bug" and s["status"] == "divergent", s["class"]
    w = json.loads((d / "tp2" / "world.json").read_text())
    assert "ties_broken" not in w and "ties_broken" not in w["timings"]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0
