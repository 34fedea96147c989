"""--fix all on transformers MoE models (tiny configs: 2 layers, 4 experts top-2, hidden 64; real
gloo worlds): bitwise at TP=1,2 for qwen3_moe, mixtral, deepseek_v3 and gpt_oss, and at TP=4 for
gpt_oss - every record of the forward (router logits, scores and chosen experts included),
backward and optimizer step. Negative control: the stock run of the same model, whose experts'
output (each rank's slice of every expert, all-reduced) differs. --fix auto confirms each cause
in turn until bitwise; an experts layout the fix does not cover is refused in one line."""
import csv
import json

import pytest

from conftest import run_cli
from hf_configs import CONFIGS, write_tiny

pytest.importorskip("transformers", minversion="5")

MODELS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
TP = {"gpt_oss": "1,2,4"}  # TP=4: one head per rank (its attention sinks' grad)


def _compare(out, model_dir, tp, *args):
    p = run_cli("compare", "--model", model_dir, "--tp", tp, "--out", str(out), "--format", "json",
                "--no-baseline", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "summary.json").read_text()), list(csv.DictReader(open(out / "diff.csv")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moefix")
    out = {}
    for kind in MODELS:
        spec = write_tiny(kind, base / kind)
        tp = TP.get(kind, "1,2")
        out[kind] = {"fixed": _compare(base / f"{kind}-fix", spec, tp, "--fix", "all", "--no-confirm")}
        if kind == "qwen3_moe":  # its stock run is round 0 of the chain
            out[kind]["auto"] = _compare(base / f"{kind}-auto", spec, "1,2", "--fix", "auto")
            out[kind]["stock"] = out[kind]["auto"]
        else:
            # forward only: the control is the experts' forward output, read from the first pass's
            # diff.csv - no own-input judgement of the modules past it (a second pass of both worlds)
            out[kind]["stock"] = _compare(base / f"{kind}-stock", spec, "1,2", "--no-confirm",
                                          "--forward-only", "--no-judge-downstream")
    return out


def _experts_out(rows, degree="2"):
    return [r for r in rows if r["degree"] == degree and r["module"].endswith("mlp.experts")
            and r["kind"] == "out"]


@pytest.mark.parametrize("kind", MODELS)
def test_fix_all_bitwise(runs, kind):
    s, rows = runs[kind]["fixed"]
    degrees = TP.get(kind, "1,2").split(",")[1:]
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]
    for d in degrees:
        assert s["degrees"][d]["status"] == "bitwise" and s["degrees"][d]["logprobs"]["bitwise"]
        mine = [r for r in rows if r["degree"] == d]
        assert mine and all(r["bitwise"] == "True" for r in mine)
        # the whole step was compared: forward, backward and the optimizer's updated weights
        assert {"forward", "backward", "optimizer"} <= {r["phase"] for r in mine}
        # the router's records, its chosen experts (int64) among them
        router = [r for r in mine if "router" in r["cls"].lower() and r["kind"] == "out"]
        assert any(r["dtype"] == "int64" for r in router), sorted({r["cls"] for r in mine})
        assert _experts_out(rows, d)


@pytest.mark.parametrize("kind", MODELS)
def test_stock_experts_diverge(runs, kind):
    # negative control: without the fix the experts' partial outputs are all-reduced in another order
    s, rows = runs[kind]["stock"]
    assert s["status"] == "divergent"
    ex = _experts_out(rows)
    assert ex and any(r["bitwise"] == "False" for r in ex)


def test_fix_auto_confirms_each_cause_until_bitwise(runs):
    s, _ = runs["qwen3_moe"]["auto"]
    chain = s["fix_chain"]
    assert chain[0]["fixes"] == [] and chain[0]["status"] == "divergent"
    assert chain[-1]["status"] == "bitwise", chain
    assert "tp-invariant-linear" in chain[1]["fixes"]
    for before, after in zip(chain, chain[1:]):
        # each round adds the fix for the cause the round before located
        assert len(after["fixes"]) == len(before["fixes"]) + 1


def test_uncovered_experts_layout_is_one_line(tmp_path):
    plan = dict(CONFIGS["qwen3_moe"].get("base_model_tp_plan") or {})
    if not plan:
        from transformers import AutoConfig

        plan = dict(AutoConfig.for_model("qwen3_moe").base_model_tp_plan)
    plan["layers.*.mlp.experts.down_proj"] = "packed_rowwise"  # a _StridedShard(-1, sf=2) cut
    spec = write_tiny("qwen3_moe", tmp_path / "m", base_model_tp_plan=plan)
    out = tmp_path / "r"
    p = run_cli("compare", "--model", spec, "--tp", "1,2", "--fix", "all", "--no-confirm",
                "--out", str(out))
    assert p.returncode == 2
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "layers.*.mlp.experts" in err and "packed_rowwise" in err, err
    assert not out.exists()  # refused before any world started


def test_group_slices_are_the_global_groups_and_grads_go_back_exactly():
    # a packed [E, 2I, H] weight cut _StridedShard(1, sf=2) over T ranks: rank r's local group j
    # is the global group r * G/T + j, at every T; backward puts each group's grad in its place
    import torch

    from tpdiag.kernels.grouped_experts import group_slices

    E, I, H, G = 3, 8, 5, 4
    w = torch.randn(E, 2 * I, H)
    gate, up = w.chunk(2, 1)
    glob = [torch.cat([gate.chunk(G, 1)[g], up.chunk(G, 1)[g]], 1) for g in range(G)]
    for T in (1, 2, 4):
        for r in range(T):
            local = torch.cat([gate.chunk(T, 1)[r], up.chunk(T, 1)[r]], 1).requires_grad_()
            groups = group_slices(local, 1, 2, G // T)
            for j, grp in enumerate(groups):
                assert torch.equal(grp, glob[r * G // T + j])
            sum(((k + 1) * grp).sum() for k, grp in enumerate(groups)).backward()
            want = torch.cat([torch.full((E, I // G, H), float(k + 1)) for k in range(G // T)] * 2, 1)
            assert torch.equal(local.grad, want)
