"""Megatron's 128-padded vocab on a model whose hidden width is 128 too
(tests/models/planted/pad128_wide.py): 100 ids, so at TP=2 rank 0's [.., 128] shard holds every real
id and has the reference's whole shape - the same shape as every hidden state.

Main at e403778 read both by the shape alone (records/layout.vocab_padded_dim): the correct twin was a
false BUG (`rank-inconsistent-replica` at the head's init: its [128, 128] weight, ambiguous, taken for
a replica), and in wide_rank_drop every [.., 128] hidden state whose ranks differ was cut to 100
columns as a vocab shard - rank 1's copy never compared - so the BUG was named at the head's init,
not at the norm's input where the rank-seeded dropout makes it. The run now records which modules
produced the padded logits (world.json vocab_padding "modules") and, where the shape cannot tell, only
their records are read as vocab shards.
"""
import json

import pytest
import torch

from conftest import run_cli

SPEC = "py:tests/models/planted/pad128_wide.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("wide_ok", "wide_rank_drop"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode, d)
    return out


def test_correct_twin_is_rounding_only(runs):
    s, stdout, gate, d = runs["wide_ok"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])
    pad = json.loads((d / "tp2" / "world.json").read_text())["vocab_padding"]
    assert pad == {"vocab": 100, "local": 128, "modules": ["head", "model"]}, pad
    rows = (d / "diff.csv").read_text().splitlines()
    head = next(r for r in rows if "s0/init/head/param_init#0/weight" in r)
    assert ",shard:0," in head and ",100x128," in head and ",True,," in head, head  # the vocab rows, bitwise


def test_rank_seeded_dropout_is_named_where_it_is_made(runs):
    s, stdout, gate, d = runs["wide_rank_drop"]
    lead = next(f for f in s["degrees"]["2"]["findings"] if "follows" not in f)
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (
        "forward", "norm", "in", "rank-inconsistent-replica"), lead
    assert not any(f["module"] == "head" and f["phase"] == "init" for f in s["degrees"]["2"]["findings"])
    assert gate == 4, gate
    rows = (d / "diff.csv").read_text().splitlines()
    norm_in = next(r for r in rows if "s0/forward/norm/in#0/0" in r)
    assert ",replicate," in norm_in and ",2x8x128," in norm_in, norm_in  # all 128 columns, not a cut


def test_square_head_weight_takes_its_rows():
    from tpdiag.records.layout import vocab_padded, vocab_padded_dim

    ref = torch.cat([torch.randn(100, 128), torch.zeros(28, 128)])
    shards = torch.stack([ref, torch.zeros(128, 128)])  # TP=2: rank 1's rows all padding
    pad = {"vocab": 100, "local": 128, "modules": ["head", "model"]}
    rm = {"world": 1, "stored": "single", "local_shape": [128, 128], "module": "head", "kind": "param_init"}
    om = {**rm, "world": 2, "stored": "stacked", "placement": None}
    ra, oa = vocab_padded(rm, ref, om, shards, pad, pad)
    assert torch.equal(ra.full, ref[:100]) and torch.equal(oa.full, ref[:100]) and oa.layout == "shard:0"
    act = {**om, "local_shape": [2, 8, 128], "kind": "out"}
    hidden = {**act, "module": "norm", "kind": "in"}
    ref_act = {**act, "world": 1}
    assert vocab_padded_dim(ref_act, [2, 8, 128], hidden, pad, pad) is None  # a hidden state: a replica
    assert vocab_padded_dim(ref_act, [2, 8, 128], act, pad, pad) == 2  # the head's output: the logits' dim
    old = {"vocab": 100, "local": 128}  # a run before the modules were recorded: the shape rule
    assert vocab_padded_dim(ref_act, [2, 8, 128], hidden, old, old) == 2


def test_no_producer_found_reads_as_the_shape_rule():
    # vocab_padding's "modules" empty (the logits no probed module's output): on 9bf6702 every record
    # whose shard has the whole shape read as no vocab record - the head's own padded output too, a
    # replica whose ranks differ (a false BUG); it is now the shape rule, as for a run without the field
    from tpdiag.records.layout import vocab_padded_dim

    act = {"world": 2, "stored": "stacked", "placement": None, "local_shape": [2, 8, 128], "module": "head",
           "kind": "out"}
    ref_act = {**act, "world": 1}
    empty = {"vocab": 100, "local": 128, "modules": []}
    assert vocab_padded_dim(ref_act, [2, 8, 128], act, empty, empty) == 2
    found = {**empty, "modules": ["head"]}  # control: with the producer known, a hidden state stays a replica
    assert vocab_padded_dim(ref_act, [2, 8, 128], {**act, "module": "norm", "kind": "in"}, found, found) is None
