"""A new user's hand-written TP Llama (tests/trial25_tp_hand.py, helper htrial25) whose 2 KV heads are
REPLICATED on neighbouring ranks at TP=4 (vLLM-style: rank r holds KV head r // 2), run through
`compare --tp 1,2,4` and `gate` as the user runs them, in real gloo worlds.

On main at 958380d the correct model's TP=4 world failed ("shards of shape [8, 32] at TP=4 cannot be
gathered into [16, 32]": records/layout.py knew no replicated blocks, gate 2), and with that gathered,
its grad norm read a false BUG (runner/per_rank.py counted each replicated KV block once per replica).
"""
import csv
import json

import pytest
import torch

from conftest import run_cli
from tpdiag.records.replicated_blocks import gather, replicated_dim

SPEC = "py:tests/trial25_tp_hand.py:"


def compare(out, func, tp, *more):
    p = run_cli("compare", "--model", SPEC + func, "--tp", tp, "--no-baseline", "--out", str(out),
                "--format", "json", *more)
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout)["degrees"]


def gate(out, *args):
    return run_cli("gate", str(out), *args)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "r"
    return out, compare(out, "target", "1,2,4")


def test_replicated_kv_heads_read_rounding_only(clean):
    out, degrees = clean
    for tp in ("2", "4"):
        d = degrees[tp]
        assert d["status"] == "divergent" and d["class"] == "rounding", d
        assert d["findings"] == [], d["findings"]
        assert d["first_divergence"]["cause"] == "row-parallel-reduction", d["first_divergence"]
    rows = [r for r in csv.DictReader(open(out / "diff.csv")) if r["degree"] == "4"]
    # each KV block taken once: the TP=4 weights gather to the reference's [2 heads x 8, 32], bitwise at init
    init = {r["module"]: r for r in rows if r["kind"] == "param_init" and r["name"] == "weight"}
    for w in ("layers.0.attn.wk", "layers.0.attn.wv"):
        assert init[w]["layout"] == "shard:0" and init[w]["shape"] == "16x32" and init[w]["bitwise"] == "True", init[w]
    # the replicas counted once in the step's grad norm: within its bound (it was 4.8e4x beyond)
    gn = next(r for r in rows if r["kind"] == "grad_norm")
    assert gn["beyond_bound"] != "True", gn
    assert gate(out, "--allow", "rounding").returncode == 0


def test_unsynced_replica_grads_are_a_bug(tmp_path):
    """The planted bug: the KV replicas' grads not summed over the ranks sharing the head (the hook
    forgotten). Right at TP=2 (no replica), wrong at TP=4: each replica's grad covers its own query
    head only - shares that add up to the reference's grad."""
    out = tmp_path / "r"
    d = compare(out, "kv_unsynced", "1,4")["4"]
    assert d["status"] == "BUG" or d["class"] == "bug", d
    roots = {(f["module"], f["kind"]): f for f in d["findings"] if "follows" not in f}
    for m in ("layers.0.attn", "layers.1.attn"):
        for w in ("wk", "wv"):
            f = roots[(f"{m}.{w}", "param_grad")]
            assert f["cause"] == "rank-inconsistent-replica", f
    rows = {r["key"]: r for r in csv.DictReader(open(out / "diff.csv")) if r["degree"] == "4"}
    assert rows["s0/backward/layers.0.attn.wk/param_grad#0/weight"]["rank_consistent"] == "False"
    g = gate(out, "--allow", "rounding")
    assert g.returncode == 4, g.stdout + g.stderr


def test_replica_grads_averaged_are_a_bug(tmp_path):
    """kv_avg: the replicas' grads averaged where each holds a different part of the sum (half at
    TP=4). The copies agree, so no replica check sees it: the reference's float64 backward of wv does,
    from its output grad - the ranks' shares, left uncompared - and calls its weight grad far."""
    out = tmp_path / "r"
    d = compare(out, "kv_avg", "1,4")["4"]
    roots = [f for f in d["findings"] if "follows" not in f]
    assert [(f["key"], f["cause"]) for f in roots] == [
        ("s0/backward/layers.0.attn.wv/param_grad#0/weight", "sharding-bug")], d["findings"]
    assert roots[0]["bound_ratio"] > 1e3, roots[0]
    g = gate(out, "--allow", "rounding")
    assert g.returncode == 4, g.stdout + g.stderr


@pytest.mark.parametrize("func,code", [("target", 0), ("kv_unsynced", 4)])
def test_under_hash_capture_too(tmp_path, func, code):
    """--capture hash (the default above 100M parameters): each rank hashes its KV block at the block's
    place in the whole, and a block's copies are composed once (probes/hash_place.py,
    runner/gather._hash_meta). On main their layout was unknown: every wk / wv record was left
    uncompared ("shard layout unknown in hash mode") and kv_unsynced passed the gate, exit 0."""
    out = tmp_path / "r"
    d = compare(out, func, "1,4", "--capture", "hash")["4"]
    assert "shard layout unknown in hash mode" not in json.dumps(d.get("not_compared") or {}), d["not_compared"]
    if code == 4:
        roots = {f["module"]: f for f in d["findings"] if "follows" not in f and f["kind"] == "param_grad"}
        assert {"layers.0.attn.wk", "layers.0.attn.wv"} <= set(roots), d["findings"]
        assert all(f["cause"] == "rank-inconsistent-replica" for f in roots.values()), roots
    else:
        assert d["class"] == "rounding" and d["findings"] == [], d
    g = gate(out, "--allow", "rounding")
    assert g.returncode == code, g.stdout + g.stderr


def test_a_bug_only_the_second_pass_names_gates_4_not_2(tmp_path):
    """The planted bug behind the first layer's rounding (late_scale): the main run's own-input pass
    names it; its confirmation rerun (tp-invariant-linear, not confirmed: the all-reduce is the
    user's) judges only a first divergence without a cause, so its summary names rounding only over
    the bug's moved records. On main that read as an edit of the confirmation ("edited after the
    run"): gate 2 over the bug's 4."""
    out = tmp_path / "r"
    d = compare(out, "late_scale", "1,2")["2"]
    assert d["class"] == "bug" and d["confirmation"]["verdict"] == "not-confirmed", d
    f = next(f for f in d["findings"] if f["key"] == "s0/forward/layers.1.attn/out#0/0")
    assert f["cause"] == "sharding-bug", f
    conf = json.loads((out / "confirm" / "tp-invariant-linear" / "summary.json").read_text())["degrees"]["2"]
    assert conf["class"] == "rounding", conf   # the rerun's own summary does not name it
    g = gate(out, "--allow", "rounding")
    assert g.returncode == 4, g.stdout + g.stderr
    assert "layers.1.attn" in g.stdout and "edited after the run" not in g.stdout + g.stderr, g.stdout


def test_replicated_dim_is_only_whole_blocks_held_more_than_once():
    assert replicated_dim([8, 32], [16, 32], 4) == (0, 2)   # 2 KV heads at TP=4
    assert replicated_dim([8, 32], [16, 32], 8) == (0, 4)
    assert replicated_dim([8, 32], [32, 32], 4) is None      # plain shards
    assert replicated_dim([6, 32], [16, 32], 3) is None      # padded (ceil), not whole blocks
    assert replicated_dim([8, 32], [24, 32], 4) is None      # 3 blocks do not divide 4 ranks
    assert replicated_dim([8, 16], [16, 32], 4) is None      # two dims shrank


def test_gather_takes_each_block_once_and_checks_its_copies():
    whole = torch.arange(16.0).reshape(4, 4)
    neighbours = [whole[0:2], whole[0:2], whole[2:4], whole[2:4]]
    full, copies, ok = gather(neighbours, 0, 2)
    assert ok and torch.equal(full, whole) and len(copies) == 2
    round_robin = [whole[0:2], whole[2:4], whole[0:2], whole[2:4]]
    full, _, ok = gather(round_robin, 0, 2)
    assert ok and torch.equal(full, whole)
    bad = [whole[0:2], whole[0:2] + 1, whole[2:4], whole[2:4]]
    full, copies, ok = gather(bad, 0, 2)
    assert not ok and torch.equal(copies[0], whole) and not torch.equal(copies[1], whole)
