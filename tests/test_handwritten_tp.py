"""Tensor parallelism written by hand with plain torch.distributed (no plan, no layout): real
gloo worlds at TP=1,2. Each bug is named `sharding-bug` from a bound the module's own records
give; the correct twins (all in one model) are reorderings within their bounds, never bugs."""
import csv
import json

import pytest

from conftest import run_cli

MODELS = "py:tests/models/handwritten.py:"


def compare(tmp_path, func, *args):
    p = run_cli("compare", "--model", MODELS + func, "--tp", "1,2", "--forward-only", "--no-confirm",
                "--no-baseline", "--out", str(tmp_path / "r"), "--format", "json", *args)
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout)["degrees"]["2"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("good")
    return tmp / "r", compare(tmp, "good", "--granularity", "auto")


def test_correct_row_parallel_is_a_named_reordering_within_its_bound(good):
    _, d = good
    fd = d["first_divergence"]
    assert fd["module"] == "layers.0" and fd["kind"] == "out", fd
    assert fd["cause"] == "row-parallel-reduction" and "why" not in fd, fd
    assert fd["max_abs"] > 0 and fd["bound"] > 0 and fd["bound_ratio"] < 1
    # the op drill-down sees the hand-written all-reduce (only at TP=2) as where it entered
    assert fd["op"] == "c10d::allreduce_" and "only at this degree" in fd["op_detail"]


def test_every_correct_hand_written_layer_is_bounded_and_inside(good):
    out, d = good
    assert d["findings"] == [], d["findings"]
    rows = {r["module"]: r for r in csv.DictReader(open(out / "diff.csv"))
            if r["phase"] == "forward" and r["kind"] == "out" and r["degree"] == "2"}
    # row-parallel, gathered column-parallel, scaled row-parallel, column shard, bare all-gather
    for m in ("layers.0", "layers.1", "layers.2", "layers.3.0", "layers.3.1"):
        r = rows[m]
        if r["bitwise"] == "True":
            continue
        # bound: at the element closest to it; beyond_bound: any element past it
        assert float(r["bound"]) > 0 and r["beyond_bound"] == "False", r


# each bug's module, and the model that bounded it
BUGS = [("layers.0", "@ weight^T + bias"),   # row-parallel: bias added on every rank
        ("layers.1", "@ weight^T + bias"),   # all-gather concatenated in reverse rank order
        ("layers.2", "@ weight^T + bias"),   # all-gather concatenated on the wrong dim
        ("layers.3", "@ weight^T"),          # 1/sqrt(local fan-in) instead of the global one
        ("layers.4.1", "* in#0")]            # parameter-free all-gather, reverse rank order


def test_every_hand_written_bug_is_a_sharding_bug(tmp_path):
    d = compare(tmp_path, "bugs")
    fd = d["first_divergence"]
    assert fd["module"] == "layers.0" and fd["cause"] == "sharding-bug", fd
    # root findings: a parent's output carrying its child's wrong result "follows" it
    found = {f["module"]: f for f in d["findings"] if "follows" not in f}
    assert sorted(found) == sorted(m for m, _ in BUGS), d["findings"]
    for m, model in BUGS:
        f = found[m]
        assert f["cause"] == "sharding-bug" and f["bound_ratio"] > 100, f
        assert f["max_abs"] > 100 * f["bound"] and model in f["bound_model"], f
