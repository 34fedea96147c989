"""A user's own tiny Phi-3 trained with `use_cache` true (transformers' default: each training forward
builds a DynamicCache the attention calls append to; tests/models/planted/hf_cache_train.py, helper
hown20), bfloat16 at TP=1,2.

Before the float64 re-executions got their own copy of the cache as it was before the call
(probes/float64_cache.py), they ran on the real one after the real call had appended to it: the
re-execution of layer 1's attention from TP=2's own inputs attended over twice the keys, 0.84
relative from TP=2's output, and the correct, unsharded attention read `sharding-bug` (27x beyond
rounding) beside the real BUG in layer 0's MLP. The twin (a correct row split) passed before too: its
re-execution attended over the reference's cached keys, which differ from TP=2's by rounding only."""
import json

import pytest

from conftest import planted_run, run_cli

ARGS = ("--tp", "1,2", "--dtype", "bfloat16")
ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("cache_mlp_bug", "cache_row_ok"):
        d, p = planted_run(tmp_path_factory, "hf_cache_train", case, *ARGS)
        gate = run_cli("gate", str(d), "--allow", "rounding")
        out[case] = (d, json.loads((d / "summary.json").read_text()), p.stdout, gate.returncode)
    return out


def _own_err(d, label="2"):
    """The relative distance of TP=2's recorded attention output from the reference's float64
    re-execution of that attention from TP=2's own inputs."""
    import torch

    from tpdiag.records.store import RecordSet

    key = f"s0/forward/{ATTN}/"
    # the own-input pass's reference world: the one that re-executed it from this side's inputs
    got = [rs for p in sorted(d.glob("*/tp1")) if (p / "events.jsonl").exists()
           for rs in [RecordSet(str(p))] if key + f"oracle#0/0@{label}" in rs.by_key]
    assert len(got) == 1, [str(p) for p in d.glob("*/tp1")]
    rs, side = got[0], RecordSet(str(d / f"tp{label}"))
    o = rs.tensor(rs.by_key[key + f"oracle#0/0@{label}"])
    out = side.tensor(side.by_key[key + "out#0/0"]).double()
    return float(torch.linalg.vector_norm(out - o) / torch.linalg.vector_norm(o))


def test_the_mis_split_mlp_is_the_bug_and_the_correct_attention_after_it_is_no_finding(runs):
    from tpdiag.diff.classes import leading_bug
    from tpdiag.records.causes import EXIT_BUG

    d, s, stdout, gate = runs["cache_mlp_bug"]
    deg = s["degrees"]["2"]
    assert s["class"] == "bug" and gate == EXIT_BUG, (gate, stdout[-2000:])
    lead = leading_bug(deg)
    assert lead["module"].startswith("model.layers.0.mlp") and lead["cause"] == "sharding-bug", lead
    assert not [f for f in deg.get("findings") or [] if f.get("module") == ATTN], deg["findings"]
    # the own-input oracle is a float64 value of TP=2's own inputs: within bf16 rounding of TP=2's
    # output (0.84 when the re-execution attended over the keys the real call had cached)
    assert _own_err(d) < 0.02


def test_the_twin_is_rounding_with_no_finding_at_the_attention(runs):
    d, s, stdout, gate = runs["cache_row_ok"]
    deg = s["degrees"]["2"]
    assert s["class"] == "rounding" and gate == 0, (gate, deg.get("findings"), stdout[-2000:])
    assert not deg.get("findings"), deg["findings"]
    assert "BUG" not in stdout


def test_a_re_execution_sees_the_cache_as_before_the_call_and_leaves_the_real_one_alone():
    """In process, no world: the snapshot keeps the cache's state before the call; module_oracle's
    re-execution (twice) equals a float64 run on a fresh cache and adds nothing to the real cache;
    a cache holding entries at the layer the module reads is refused for another side's inputs."""
    import copy

    import torch
    from transformers import DynamicCache

    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "tpdiag_planted_hf_cache_train", Path(__file__).parent / "models" / "planted" / "hf_cache_train.py")
    planted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planted)
    from tpdiag.probes.float64 import module_oracle, snapshot
    from tpdiag.probes.float64_cache import read_slots_empty

    torch.manual_seed(1)
    model = planted._model()
    attn, rot = model.model.layers[1].self_attn, model.model.rotary_emb
    h = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    pid = torch.arange(8)[None]
    cos, sin = rot(h, pid)
    cache = DynamicCache(config=model.config)
    kw = dict(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None, position_ids=pid,
              past_key_values=cache)
    snap = snapshot(((), kw))
    assert read_slots_empty(attn, snap)
    with torch.no_grad():
        attn(**kw)  # the real call: appends 8 positions to layer 1's slot
        assert cache.get_seq_length(1) == 8
        want = copy.deepcopy(attn).double()(hidden_states=h.double(), attention_mask=None, position_ids=pid,
                                            position_embeddings=(cos.double(), sin.double()))[0]
    for _ in range(2):
        got, notes = module_oracle(attn, *snap)
        assert "why" not in notes, notes
        assert torch.equal(got[0], want)
    assert cache.get_seq_length(1) == 8  # the real cache: nothing of the re-executions' added
    assert not read_slots_empty(attn, snapshot(((), kw)))  # layer 1's slot now holds entries
