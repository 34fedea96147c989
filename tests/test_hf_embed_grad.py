"""A causal LM laid out as transformers lays one out - its body a child named `model` - whose body's own
code sums the embeddings' grad over the ranks once more than the plan does (Megatron's f in front of a
ColwiseParallel layer; tests/models/planted/hf_embed_grad.py, helper hname18), in bfloat16 at TP=1,2.

Before the root's module records got their own name ("(root)", records/keys.ROOT_NAMESAKE) the root
and that child both recorded as "model": two calls under one name, so the child's float64 backward
never judged the grads its code reads. The embeddings' output grad, 16% off, stayed "not judged"
below the bfloat16 limit (0.2 of its norm) and the run read "nothing is wrong", `gate --allow
rounding` exit 0. Now the child judges it: a BUG; the twin is rounding with nothing left unjudged."""
import json

import pytest

from conftest import planted_run, run_cli

ARGS = ("--tp", "1,2", "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("embed_grad_twice", "embed_grad_ok"):
        d, p = planted_run(tmp_path_factory, "hf_embed_grad", case, *ARGS)
        gate = run_cli("gate", str(d), "--allow", "rounding")
        out[case] = (d, json.loads((d / "summary.json").read_text()), p.stdout, gate.returncode)
    return out


def test_the_embeddings_grad_summed_once_more_is_a_bug_judged_by_the_model_child(runs):
    from tpdiag.diff.classes import leading_bug
    from tpdiag.records.causes import EXIT_BUG

    d, s, stdout, gate = runs["embed_grad_twice"]
    deg = s["degrees"]["2"]
    assert s["class"] == "bug" and gate == EXIT_BUG, (gate, deg.get("not_judged"), stdout[-2000:])
    lead = leading_bug(deg)
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == \
        ("backward", "model.embed_tokens", "grad_out", "sharding-bug"), lead
    # judged by the float64 backward of the body (the `model` child), whose code reads the grad
    assert lead.get("enclosing") == "model", lead
    assert not deg.get("not_judged"), deg.get("not_judged")
    assert deg["logprobs"]["max_abs"] < 1e-3  # the forward is right


def test_the_twin_is_rounding_with_nothing_left_unjudged(runs):
    d, s, stdout, gate = runs["embed_grad_ok"]
    deg = s["degrees"]["2"]
    assert s["class"] == "rounding" and gate == 0, (gate, deg)
    assert not deg.get("findings"), deg["findings"]
    assert not deg.get("not_judged"), deg["not_judged"]
    assert "BUG" not in stdout


def test_the_root_and_its_model_child_record_under_their_own_names(runs):
    from tpdiag.records.keys import ROOT_NAMESAKE

    d = runs["embed_grad_ok"][0]
    for lab in ("1", "2"):
        outs = {}
        for line in (d / f"tp{lab}" / "events.jsonl").read_text().splitlines():
            m = json.loads(line)
            if (m["phase"], m["kind"]) == ("forward", "out") and m["module"] in ("model", ROOT_NAMESAKE):
                outs.setdefault(m["module"], set()).add((m["call"], m.get("cls")))
        # one call each (format 2: "model" twice, the root's call 0 and the child's call 1)
        assert outs == {ROOT_NAMESAKE: {(0, "ForCausalLM")}, "model": {(0, "Model")}}, (lab, outs)
