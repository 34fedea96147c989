"""The catalogue of planted TP mistakes (tests/models/planted/), each beside its correct twin,
judged by the default `tpdiag compare` flow at TP=2 and TP=4: every mistake is named with a
bug-class cause at its own module; no correct twin gets a bug-class cause anywhere.

One compare per model (TP=1,2,4 in one run): the forward mistakes sit side by side as branches
of one model (branches.py), each reading the same bitwise-equal input, so each is judged on its
own; the training mistakes (embedding, loss, replicated grad) each have a model of their own.
"""
import json
import os

import pytest

from conftest import run_cli
from tpdiag.records.causes import cause_class

HERE = os.path.dirname(os.path.abspath(__file__))
PLANTED = os.path.join(HERE, "models", "planted")


def compare(tmp, spec, *args):
    p = run_cli("compare", "--model", f"py:{PLANTED}/{spec}", "--tp", "1,2,4", "--no-confirm", "--no-baseline",
                "--format", "json", "--out", str(tmp / "r"), *args, env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return json.loads(p.stdout)


def bug_modules(entry) -> dict:
    """module -> bug-class cause, over the first divergence and the root findings."""
    out = {}
    fd = entry.get("first_divergence") or {}
    for f in [fd] + [f for f in entry.get("findings") or [] if "follows" not in f]:
        if cause_class(f.get("cause")) == "bug":
            out.setdefault(f["module"], f["cause"])
    return out


@pytest.fixture(scope="module")
def branch_bugs(branches_bugs_run):
    # conftest's session run of compare(..., "branches.py:bugs", "--forward-only") (test_tamper_findings gates it)
    return json.loads((branches_bugs_run / "summary.json").read_text())


@pytest.fixture(scope="module")
def branch_good(tmp_path_factory):
    return compare(tmp_path_factory.mktemp("good"), "branches.py:good", "--forward-only")


FORWARD = {"norm": "a LayerNorm over a column shard", "softmax": "a softmax over a column shard",
           "bias": "the bias added on every rank", "twice": "a double all-reduce",
           "noreduce": "a missing all-reduce", "mean": "a mean divided by the local width",
           "gqa": "GQA kv heads mapped wrong under TP", "rope": "RoPE positions offset per rank",
           "seqpar": "a sequence-parallel gather in the wrong order"}


@pytest.mark.parametrize("degree", ["2", "4"])
@pytest.mark.parametrize("branch", sorted(FORWARD))
def test_each_forward_mistake_is_a_bug_at_its_module(branch_bugs, branch, degree):
    entry = branch_bugs["degrees"][degree]
    found = bug_modules(entry)
    assert f"branch.{branch}" in found, (FORWARD[branch], found)
    assert entry["class"] == "bug" and branch_bugs["class"] == "bug"


@pytest.mark.parametrize("degree", ["2", "4"])
def test_no_correct_twin_is_called_a_bug(branch_good, degree):
    entry = branch_good["degrees"][degree]
    assert entry["status"] == "divergent"  # the hand-written reductions do reorder sums
    assert bug_modules(entry) == {}, entry
    assert entry["class"] == "rounding" and branch_good["class"] == "rounding"
    fd = entry["first_divergence"]
    # judged from first principles: near its float64 re-execution
    v = fd.get("oracle") or fd.get("op_oracle")
    assert v is not None and not v["far"] and v["ratio"] < 1, fd


def test_the_default_flow_names_the_op_of_a_mistake_no_layout_covers(branch_bugs):
    fd = branch_bugs["degrees"]["2"]["first_divergence"]
    # the LayerNorm branch comes first: pass 1 saw only its module; the second pass named the
    # op inside it and re-executed both in float64
    assert fd["module"] == "branch.norm" and fd["cause"] == "sharding-bug", fd
    assert fd["op"] == "aten::native_layer_norm", fd
    assert fd["oracle"]["far"] and fd["oracle"]["ratio"] > 100, fd


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    return {name: compare(tmp_path_factory.mktemp(name), f"lm.py:{name}")
            for name in ("good", "embed_bug", "loss_bug", "grad_bug")}


@pytest.mark.parametrize("degree", ["2", "4"])
def test_training_mistakes_are_bugs_where_they_are_made(lm_runs, degree):
    embed = bug_modules(lm_runs["embed_bug"]["degrees"][degree])
    assert "embed" in embed, embed
    loss = lm_runs["loss_bug"]["degrees"][degree]
    hits = [f for f in loss["findings"] if "follows" not in f and cause_class(f["cause"]) == "bug"]
    assert hits and hits[0]["phase"] == "loss", loss["findings"]
    grad = lm_runs["grad_bug"]["degrees"][degree]
    hits = [f for f in grad["findings"] if "follows" not in f and cause_class(f["cause"]) == "bug"]
    assert hits and (hits[0]["module"], hits[0]["kind"], hits[0]["name"]) == ("mlp", "param_grad", "gain"), hits
    good = lm_runs["good"]["degrees"][degree]
    assert bug_modules(good) == {} and good["class"] == "rounding", good


def test_clean_bf16_model_with_norms_attention_and_gated_mlp_has_no_bug(tmp_path):
    """tiny-llama (RMSNorm, softmax attention, SwiGLU) in bf16 at TP=1,2,4: rounding only."""
    p = run_cli("compare", "--tp", "1,2,4", "--dtype", "bfloat16", "--no-confirm", "--no-baseline", "--format",
                "json", "--out", str(tmp_path / "r"), env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    for lab, entry in s["degrees"].items():
        assert bug_modules(entry) == {}, (lab, entry)
        assert entry["class"] in ("rounding", None), (lab, entry)


@pytest.fixture(scope="module")
def backward_runs(tmp_path_factory):
    return {name: compare(tmp_path_factory.mktemp(name), f"backward.py:{name}")
            for name in ("summed", "averaged")}


@pytest.mark.parametrize("degree", ["2", "4"])
def test_a_mistake_only_in_backward_is_a_bug_at_its_weight_grad(backward_runs, degree):
    """Forward, loss and activation grads right; the weight grad averaged over the TP ranks
    instead of summed: judged by the module's backward re-executed in float64."""
    fd = backward_runs["averaged"]["degrees"][degree]["first_divergence"]
    assert (fd["phase"], fd["module"], fd["kind"], fd["name"]) == ("backward", "layer", "param_grad", "weight"), fd
    assert fd["cause"] == "sharding-bug" and fd["oracle"]["far"], fd
    good = backward_runs["summed"]["degrees"][degree]
    assert bug_modules(good) == {} and good["class"] == "rounding", good
    gfd = good["first_divergence"]
    # the input grad of the hand-rolled layer, all-reduced over the output shards: rounding,
    # judged against the layer's own float64 backward
    assert (gfd["kind"], gfd["cause"]) == ("grad_out", "column-parallel-dgrad") and not gfd["oracle"]["far"], gfd
