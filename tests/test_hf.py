"""`--model hf:DIR`: transformers' own TP plan on tiny Llama and Qwen3, in real gloo worlds."""
import csv
import json

import pytest

from conftest import run_cli
from hf_configs import write_tiny

pytest.importorskip("transformers", minversion="5")

DEGREES = ("2", "4")
ROW_PARALLEL = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")


def _compare(tmp_path_factory, kind):
    base = tmp_path_factory.mktemp(kind)
    spec = write_tiny(kind, base / "model")
    out = base / "run"
    # no baseline rerun: what these tests check is the degrees against TP=1; nor the own-input
    # judgement past the first divergence (a second pass of TP=1, 2 and 4): the readers check pass 1
    # - the first divergence, its layout bound, diff.csv's rows, events.jsonl - and pass 1's
    # layout-bound findings stay findings without it (it clears only those its float64
    # re-execution finds within rounding). It judges these two models at TP=1,2 in test_hf_zoo.py
    # and an hf: model at TP=4 (gpt_oss, TP=1,4) in test_hf_plans.py
    p = run_cli("compare", "--model", spec, "--tp", "1,2,4", "--out", str(out), "--no-confirm",
                "--no-baseline", "--no-judge-downstream", "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    with open(out / "diff.csv") as f:
        rows = list(csv.DictReader(f))
    return json.loads((out / "summary.json").read_text()), rows, out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _compare(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _compare(tmp_path_factory, "qwen3")


def _check_run(summary, rows, extra_bitwise=()):
    assert summary["status"] == "divergent" and set(summary["degrees"]) == set(DEGREES)
    for label in DEGREES:
        d = summary["degrees"][label]
        fd = d["first_divergence"]
        # CPU fp32: column shards of a GEMM are bitwise; the first difference is a layer-0
        # row-parallel partial-sum all-reduce, inside its reordering bound.
        assert fd["phase"] == "forward" and fd["module"] in ROW_PARALLEL, (label, fd)
        assert fd["cause"] == "row-parallel-reduction" and 0 < fd["max_abs"] <= fd["bound"]
        assert d["findings"] == [], (label, d["findings"])  # nothing beyond a rounding bound
        assert d["unmatched"] == [] and d["missing"] == []
        assert d["logprobs"]["bitwise"] is False and d["logprobs"]["token_mult_prob_error"] > 1.0
        mine = {r["key"]: r for r in rows if r["degree"] == label}
        assert all(r["bitwise"] == "True" for r in mine.values() if r["phase"] == "init")
        assert mine[f"s0/forward/{fd['module']}/in#0/0"]["bitwise"] == "True"
        for mod in ("q_proj", "k_proj", "v_proj", *extra_bitwise):
            r = mine[f"s0/forward/model.layers.0.self_attn.{mod}/out#0/0"]
            # HF hands plain local tensors to hooks: the layout is inferred from the shape.
            assert r["bitwise"] == "True" and r["layout"] == "shard:2", (label, mod, r)
        # act_fn is unplanned: its column-sharded output is inferred from the shape too, and an
        # elementwise op of bitwise-equal shards is bitwise equal (whatever came before it).
        act_in = mine["s0/forward/model.layers.0.mlp.act_fn/in#0/0"]
        act = mine["s0/forward/model.layers.0.mlp.act_fn/out#0/0"]
        assert act["layout"] == "shard:2" and act["bitwise"] == act_in["bitwise"], (label, act)


def test_llama_first_divergence(llama):
    _check_run(*llama[:2])


def test_llama_final_norm_is_linked_to_the_head_through_its_slice(llama):
    # LlamaForCausalLM feeds lm_head `hidden_states[:, slice, :]`, a view of model.norm's
    # output: the link makes the norm's grad_out the head's column-parallel dgrad, not unknown
    from tpdiag.diff.locate import classify

    for label in DEGREES:
        events = [json.loads(x) for x in open(llama[2] / f"tp{label}" / "events.jsonl")]
        by_key = {e["key"]: e for e in events}
        norm = by_key["s0/backward/model.norm/grad_out#0/0"]
        assert norm["consumers"] == ["lm_head"], norm
        # the head's style as recorded: the cause locate() names should this grad diverge first
        head_style = by_key["s0/forward/lm_head/out#0/0"]["style"]
        assert classify({**norm, "consumer_styles": [head_style]}) == "column-parallel-dgrad"


def test_qwen3_first_divergence_and_head_norms(qwen3):
    summary, rows, _ = qwen3
    _check_run(summary, rows, extra_bitwise=("q_norm", "k_norm"))
    for label in DEGREES:
        # q_norm/k_norm weight grads are all-reduced before tpdiag records them: the replica is
        # consistent across ranks (no false rank-inconsistent-replica).
        for r in rows:
            if r["degree"] == label and r["kind"] == "param_grad" and r["module"].endswith("_norm"):
                assert r["rank_consistent"] != "False", r


@pytest.mark.parametrize("tp,needle", [("1,3", "num_attention_heads=16"),
                                       ("1,16", "num_key_value_heads=8")])
def test_degree_not_dividing_heads_is_bad_input(tmp_path, tp, needle):
    spec = write_tiny("llama", tmp_path / "model")
    p = run_cli("compare", "--model", spec, "--tp", tp, "--out", str(tmp_path / "r"))
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"--tp {tp.split(',')[1]}: does not divide" in lines[0] and needle in lines[0], lines[0]
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()


def test_tied_embedding_stays_tied_after_sharding():
    """A tied LM head and embedding remain one parameter after the plan shards both (mesh of 1)."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from tpdiag.models.hf import load_hf_target

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as d:
            write_tiny("qwen3", d, tie_word_embeddings=True, num_hidden_layers=1)
            torch.manual_seed(0)
            t = load_hf_target(d)
        m = t.model
        assert m.lm_head.weight is m.model.embed_tokens.weight
        parallelize_module(m, init_device_mesh("cpu", (1,)), t.plan)
        assert isinstance(m.lm_head.weight, DTensor) and m.lm_head.weight is m.model.embed_tokens.weight
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_root_and_its_model_child_record_under_their_own_names(kind, request):
    """HF's CausalLM root records as "(root)", its `model` child as "model", one call each (hname18:
    both were "model", calls 0 and 1, and the child's float64 backward never judged the grads its
    code reads - the embeddings' output grad). The diff leaves the root out of the own-input
    judgement (its float64 run would be the whole model). Their divergent records are, in every
    world, the very tensors of records judged under their own names - the child's output and its
    grad model.norm's, the root's output and its grad lm_head's - and their inputs are the tokens."""
    import torch

    from tpdiag.records.store import RecordSet

    run = request.getfixturevalue(kind)[2]
    same = {"s0/forward/model/out#0/0": "s0/forward/model.norm/out#0/0",
            "s0/backward/model/grad_out#0/0": "s0/backward/model.norm/grad_out#0/0",
            "s0/forward/(root)/out#0/0": "s0/forward/lm_head/out#0/0",
            "s0/backward/(root)/grad_out#0/0": "s0/backward/lm_head/grad_out#0/0"}
    for label in ("1", *DEGREES):
        rs = RecordSet(str(run / f"tp{label}"))
        by = {m["key"]: m for m in rs.events}
        mine = sorted(k for k in by if k.split("/")[1] in ("forward", "backward") and k.split("/")[2] in ("model", "(root)"))
        assert mine == sorted([*same, "s0/forward/model/in#0/0", "s0/forward/(root)/in#0/0"]), (label, mine)
        for k, other in same.items():
            assert torch.equal(rs.tensor(by[k]), rs.tensor(by[other])), (label, k, other)
        for k in ("s0/forward/model/in#0/0", "s0/forward/(root)/in#0/0"):
            assert not rs.tensor(by[k]).is_floating_point(), (label, k)
