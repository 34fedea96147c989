"""A `py:` Target whose plan is a `from_pretrained` model's own `model.tp_plan` - transformers'
style names, not torch ParallelStyles - runs those names as an `hf:` model does (transformers' own
registered styles). Before, every TP=2 rank raised `TypeError: Expect Union[ParallelStyle, Dict[str,
ParallelStyle]] for parallelize_plan, <class 'str'> found!` and the run was inconclusive (gate 2).
The correct plan reads rounding; the same plan with the per-head norms' grad all-reduce left out
reads BUG; a misspelt style name is refused in one line. A Qwen3-MoE whose every layer is MoE
keeps its class plan's dense `mlp.gate_proj` entries in `model.tp_plan` (transformers skips them):
they are skipped, not refused as entries that match no module, and the packed experts'
`experts.gate_up_proj: packed_colwise` goes to the experts module's style."""
import json
import os

import pytest
import torch

from conftest import ROOT, run_cli

pytest.importorskip("transformers", minversion="5")

USER = os.path.join(ROOT, "tests", "models", "user_hf_plan.py")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                               max_position_embeddings=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():   # norms off their init (ones), so each head's norm grad is its own
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                               max_position_embeddings=64, tie_word_embeddings=False, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    path = tmp_path_factory.mktemp("qwen3_moe") / "ckpt"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def _compare(ckpt, tmp_path, func):
    out = str(tmp_path / func)
    p = run_cli("compare", "--model", f"py:{USER}:{func}", "--tp", "1,2", "--no-confirm", "--no-baseline",
                "--format", "json", "--out", out, env={"USER_HF_PLAN_DIR": ckpt})
    return p, out


def _gate(out, *args):
    return run_cli("gate", out, *args, env={}).returncode


def test_model_tp_plan_names_run_as_transformers_styles(qwen3, tmp_path):
    p, out = _compare(qwen3, tmp_path, "tp_plan")
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)["degrees"]["2"]
    assert d["status"] == "divergent" and d["class"] == "rounding", json.dumps(d)[:2000]
    assert not [f for f in d["findings"] if f.get("cause") in ("sharding-bug", "rank-inconsistent-replica")], d
    # the row-parallel o_proj's reduction is the first difference: q/k/v were cut (a plan of
    # strings that sharded nothing would be bitwise)
    assert d["first_divergence"]["cause"] == "row-parallel-reduction", d["first_divergence"]
    assert _gate(out, "--allow", "rounding") == 0


def test_norms_left_out_of_the_names_plan_is_a_bug(qwen3, tmp_path):
    p, out = _compare(qwen3, tmp_path, "norms_unreduced")
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)["degrees"]["2"]
    assert d["class"] == "bug", json.dumps(d)[:2000]
    bad = [f for f in [d["first_divergence"], *d["findings"]] if f.get("cause") == "rank-inconsistent-replica"]
    assert bad and all(f["module"].endswith(("q_norm", "k_norm")) for f in bad), json.dumps(d)[:2000]
    assert _gate(out, "--allow", "rounding") == 4


def test_a_misspelt_style_name_is_one_line(qwen3, tmp_path):
    # from_pretrained does not build on the meta device, so the parent's plan check cannot read
    # this model; the rank that loads it refuses the name, in the line that says what failed
    p, out = _compare(qwen3, tmp_path, "misspelt")
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    err = json.loads(p.stdout)["error"]
    assert "raised BadInput" in err and "\n" not in err, err
    assert "'colwsie' is not a transformers TP style name; did you mean 'colwise'?" in err, err


def test_moe_tp_plan_skips_the_class_plan_entries_it_does_not_build(qwen3_moe, tmp_path):
    p, out = _compare(qwen3_moe, tmp_path, "tp_plan")
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)["degrees"]["2"]
    assert d["status"] == "divergent" and d["class"] == "rounding", json.dumps(d)[:2000]
    assert not [f for f in d["findings"] if f.get("cause") in ("sharding-bug", "rank-inconsistent-replica")], d
    assert _gate(out, "--allow", "rounding") == 0
