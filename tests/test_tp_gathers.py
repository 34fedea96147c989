"""More of a user's hand-written TP mistakes (tests/models/planted/tp_gathers.py, tp_heads.py,
tp_router.py), each
beside its correct twin, run as a user runs them: `tpdiag compare py:... --tp 1,2`, then `tpdiag gate`.

- gather_dim0: a gather_output column layer whose all_gather_into_tensor stack (dim 0) is viewed as
  the columns: BUG at that layer's forward.
- vocab_pad: a vocabulary padded to a multiple of TP (31 ids at TP=2), the padding's logits left in
  the hand-written vocab-parallel cross-entropy: BUG at the loss. Main at bb2f420 failed every
  hand-written vocab-parallel head (Megatron's ColumnParallelLinear, parallel_output=True, no
  DTensor anywhere), the twins too: its logits were taken whole (`Target 30 is out of bounds` in
  tpdiag's own logprobs), and a padded head's weight "cannot be gathered into [31, 32]". The
  logits are now made whole on the world's mesh and the padding cut (runner/logits.py), the
  padded shards gathered and cut (records/layout.py), and the grad of such plain vocab-shard
  logits is `vocab-parallel-softmax` as a planned head's is (diff/layout_cause.py).
- grad_sync_all: a DDP-style average of every grad over the (TP-only) world, shards included: BUG
  at the first shard's weight grad.
- heads_view: q/k/v viewed as (B, S, n_heads, -1) with the GLOBAL head count: BUG at the attention.
- router_split: a plan wildcard that makes an MoE's router ColwiseParallel (each rank routes over its
  half of the experts, with local ids): BUG at the MoE, its ranks disagree.
"""
import json

import pytest

from conftest import run_cli

CASES = {c: ("tp_gathers", c, ()) for c in ("gather_dim0", "gather_ok", "vocab_pad", "vocab_pad_ok", "vocab_split_ok",
                                              "vocab_split_copy", "grad_sync_all", "grad_sync_ok")}
CASES.update({c: ("tp_heads", c, ()) for c in ("heads_view", "heads_ok")})
CASES.update({c: ("tp_router", c, ()) for c in ("router_split", "router_ok")})
# hash capture: the padded head's records hashed without their padding (probes/recorder.py); they
# were "unknown" layout there, and the twin read `not judged`
CASES["vocab_pad_ok_hash"] = ("tp_gathers", "vocab_pad_ok", ("--capture", "hash"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, (f, func, more) in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/{f}.py:{func}", "--tp", "1,2", "--no-baseline",
                    "--no-confirm", *more, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


def _lead(s):
    from tpdiag.diff.classes import leading_bug

    return leading_bug(s["degrees"]["2"])


@pytest.mark.parametrize("case", ["gather_ok", "vocab_pad_ok", "vocab_split_ok", "grad_sync_ok", "heads_ok",
                                  "vocab_pad_ok_hash", "router_ok"])
def test_the_twins_are_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), (case, s["degrees"]["2"].get("findings"))
    assert "BUG" not in stdout and gate == 1, (case, gate, stdout[-1500:])


@pytest.mark.parametrize("case", ["vocab_pad_ok", "vocab_split_ok", "vocab_pad_ok_hash"])
def test_a_hand_written_vocab_parallel_heads_logit_grad_is_the_vocab_softmax(runs, case):
    s, _, _ = runs[case]
    fd = s["degrees"]["2"]["first_divergence"]
    # the logits' grad (the loss's backward over the all-reduced exp sums), or the loss itself
    assert fd["cause"] == "vocab-parallel-softmax", fd
    assert (fd["phase"], fd["module"]) in (("backward", "head"), ("loss", "model")), fd


@pytest.mark.parametrize("case,where,ratio,said", [
    ("gather_dim0", ("forward", "mlp.up", "out", "sharding-bug"), 1e5, "forward: mlp.up,"),
    ("vocab_pad", ("loss", "model", "loss", "sharding-bug"), 1e2, "loss: the loss function"),
    ("grad_sync_all", ("backward", "mlp.down", "param_grad", "sharding-bug"), 1e5,
     "backward: mlp.down (param_grad weight)"),
    ("heads_view", ("forward", "attn", "op", "sharding-bug"), 1e5, "forward: attn :: aten::_scaled_dot_product"),
])
def test_each_mistake_is_a_bug_where_it_sits(runs, case, where, ratio, said):
    s, stdout, gate = runs[case]
    lead = _lead(s)
    assert s["class"] == "bug" and lead is not None, (case, s["degrees"]["2"].get("findings"))
    got = (lead["phase"], lead["module"], "op" if lead.get("op") else lead["kind"], lead["cause"])
    assert got == where, (case, lead)
    assert lead["bound_ratio"] > ratio, (case, lead)
    assert f"BUG (a wrong result, not rounding) at TP=2 {said}" in stdout, stdout
    assert gate == 4, case


def test_a_router_caught_by_the_plan_routes_each_rank_its_own_way(runs):
    s, stdout, gate = runs["router_split"]
    lead = _lead(s)
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"].get("findings")
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "forward", "moe", "out", "rank-inconsistent-replica"), lead
    assert "BUG (a wrong result, not rounding) at TP=2 forward: moe" in stdout and gate == 4


def test_the_grad_sync_names_every_shard_it_averaged(runs):
    s, _, _ = runs["grad_sync_all"]
    bugs = {(f["module"], f["name"]) for f in s["degrees"]["2"]["findings"] if f["cause"] == "sharding-bug"}
    # the row shard's weight and the column shard (a parameter of mlp itself); no replica
    assert bugs == {("mlp.down", "weight"), ("mlp", "up")}, s["degrees"]["2"]["findings"]


def test_padded_shards_are_gathered_and_their_padding_cut():
    import torch

    from tpdiag.errors import NotComparable
    from tpdiag.records.layout import assemble, padded_dim

    assert padded_dim([16, 32], [31, 32], 2) == 0 and padded_dim([8, 32], [30, 32], 4) == 0
    assert padded_dim([16, 32], [32, 32], 2) is None  # even: a plain shard (shard_dim's)
    assert padded_dim([17, 32], [31, 32], 2) is None  # more than ceil(V/TP) rows: no padding rule
    assert padded_dim([16, 16], [31, 32], 2) is None  # two dims differ
    # replicas, not padding: 2 KV heads at TP=4 (rank r holds head r // 2), 4 at TP=8, 3 at TP=4
    # (its last rank would hold padding only) - cut as padding they read a false difference
    assert padded_dim([2, 1, 5, 8], [2, 2, 5, 8], 4) is None and padded_dim([2, 1, 5, 8], [2, 4, 5, 8], 8) is None
    assert padded_dim([1, 4], [3, 4], 4) is None
    # ... gathered with each head once (records/replicated_blocks.py; they were refused until htrial25)
    heads = torch.randn(2, 2, 5, 8)
    kv = {"key": "s0/forward/attn/in#0/0", "world": 4, "local_shape": [2, 1, 5, 8], "stored": "ranks"}
    a = assemble(kv, torch.stack([heads[:, r // 2:r // 2 + 1] for r in range(4)]), [2, 2, 5, 8])
    assert torch.equal(a.full, heads) and a.layout == "shard:1" and a.rank_consistent is None
    # 3 heads do not divide 4 ranks: no rule places them
    three = torch.randn(3, 4)
    with pytest.raises(NotComparable, match="cannot be gathered"):
        assemble({**kv, "local_shape": [1, 4]}, torch.stack([three[min(r, 2):min(r, 2) + 1] for r in range(4)]), [3, 4])
    whole = torch.randn(31, 4)
    padded = torch.cat([whole, torch.zeros(1, 4)])
    meta = {"key": "s0/init/head/param_init#0/weight", "world": 2, "local_shape": [16, 4], "stored": "ranks"}
    a = assemble(meta, torch.stack([padded[:16], padded[16:]]), [31, 4])
    assert torch.equal(a.full, whole) and a.layout == "shard:0" and a.rank_consistent is None
    with pytest.raises(NotComparable, match="cannot be gathered"):
        assemble({**meta, "local_shape": [15, 4]}, torch.stack([whole[:15], whole[15:30]]), [31, 4])


def test_a_hand_written_losss_grad_times_tp_is_a_bug_not_the_vocab_softmax(runs):
    # the logits' grad of a user's own vocab-parallel loss has no bound and nothing re-executes it:
    # named by its layout alone, every grad TP times read `vocab-parallel-softmax`, rounding only
    # (gate 1). The one-factor check (diff/scale.py) now reads compare's backward records too
    s, stdout, gate = runs["vocab_split_copy"]
    lead = _lead(s)
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "backward", "head", "grad_out", "sharding-bug"), lead
    assert lead["why"].startswith("every element is 2x the reference's"), lead
    assert "BUG (a wrong result, not rounding) at TP=2 backward: head" in stdout and gate == 4
