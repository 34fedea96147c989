"""The engine reproduced: a rollout written by transformers' own generate() - a batch of left-padded
prompts in one call, KV cache, sampled, logprobs of the chosen tokens from its raw logits - is
recomputed bit for bit by `tpdiag rollout`'s configuration at the engine's own settings (TP=1,
micro-batch = the engine's batch, decode, no fix, PyTorch's default flags), which is then named
closest; where nothing tried reproduces it, the summary says so instead of naming a closest
configuration as if it explained the engine."""
import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tpdiag_example_hf_rollout_engine",
                                               os.path.join(ROOT, "examples", "hf_rollout.py"))
engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine)

LENS = (5, 8, 6, 7)  # one batch of 4, left-padded to 8
NEW = 10
ENGINE = "tp1-mb4-decode-none"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a large rope_theta: RoPE's inv_freq rounded to bf16 (the old .to(dtype)) is visibly wrong
    return engine.write_model(str(tmp_path_factory.mktemp("engine") / "model"), rope_theta=500000.0)


def _write(tmp_path, seqs) -> str:
    path = str(tmp_path / "rollout.jsonl")
    with open(path, "w") as f:
        f.write(engine.as_jsonl(seqs))
    return path


def _rollout(path, model, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    return run_rollout(RolloutConfig(file=path, model="hf:" + model, **kw))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_batch_is_reproduced_bitwise_and_named_closest(tmp_path, model_dir, dtype):
    seqs = engine.generate_batch(model_dir, dtype, LENS, NEW)
    det_before = torch.are_deterministic_algorithms_enabled()
    s = _rollout(_write(tmp_path, seqs), model_dir, dtype=dtype, micro_batch=(4, 1),
                 modes=("prefill", "decode"), fixes=("none",))
    n = len(LENS) * NEW
    m = s["configurations"][ENGINE]["metrics"]
    assert m["exact_tokens"] == n and m["token_mult_prob_error"] == 1.0 and m["max_abs"] == 0.0
    assert s["closest"]["reproduced"] is True
    assert ENGINE in s["closest"]["configurations"]
    for lab in s["closest"]["configurations"]:  # nothing inexact is named with it
        assert s["configurations"][lab]["metrics"]["exact_tokens"] == n
    # PyTorch's default flags, recorded, and this process's own put back afterwards
    assert s["flags"]["default"]["values"]["deterministic_algorithms"] is False
    assert torch.are_deterministic_algorithms_enabled() == det_before
    if dtype == "bfloat16":  # prefill computes the same rows in other GEMM shapes: not the engine
        assert s["configurations"]["tp1-mb4-prefill-none"]["metrics"]["exact_tokens"] < n


def test_bf16_negative_control_the_cast_model_does_not_reproduce(tmp_path, model_dir, monkeypatch):
    """The model tpdiag ran before (float32 built, .to(bfloat16): inv_freq in bf16) is another
    model: not one token of the engine's is reproduced bitwise by it, and the summary says so."""
    from tpdiag.models import dtypes

    seqs = engine.generate_batch(model_dir, "bfloat16", LENS, NEW)
    monkeypatch.setattr(dtypes, "rule_for", lambda kind, model, dtype: dtypes.module_to(dtype))
    s = _rollout(_write(tmp_path, seqs), model_dir, dtype="bfloat16", micro_batch=(4,),
                 modes=("decode",), fixes=("none",))
    m = s["configurations"][ENGINE]["metrics"]
    assert m["exact_tokens"] < m["tokens"] and m["token_mult_prob_error"] > 1.0
    assert s["closest"]["reproduced"] is False
    assert s["closest"]["explanation"].startswith("not reproduced: no configuration tried")


def test_eager_engine_not_reproduced_by_sdpa_then_found_on_the_attention_axis(tmp_path, model_dir):
    """An engine that ran eager attention: the model's own (SDPA) configurations do not reproduce it
    - the output says so in words and marks the nearest as nearest - and with eager on the
    attention axis, that configuration reproduces it and is the one named."""
    from tests.conftest import run_cli

    seqs = engine.generate_batch(model_dir, "bfloat16", LENS, NEW, attn_implementation="eager")
    path = _write(tmp_path, seqs)
    common = ["rollout", path, "--model", "hf:" + model_dir, "--dtype", "bfloat16", "--micro-batch", "4",
              "--mode", "decode", "--fix", "none", "--device", "cpu"]
    p = run_cli(*common)
    assert p.returncode == 0, p.stderr + p.stdout
    assert "*nearest" in p.stdout and "*closest" not in p.stdout and "*reproduces" not in p.stdout
    assert "not reproduced: no configuration tried gives the engine's bits" in p.stdout
    assert "flags default: deterministic algorithms off" in p.stdout
    p = run_cli(*common, "--attention", "auto,eager", "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(p.stdout)
    assert s["closest"] == {**s["closest"], "reproduced": True, "configurations": [f"{ENGINE}-eager"]}
    assert s["configurations"][ENGINE]["metrics"]["exact_tokens"] < len(LENS) * NEW


def test_padding_and_attention_axes_where_they_cannot_run(tmp_path, model_dir):
    """Left-padded prefill at micro-batch 1 pads nothing: the same bits as right-padded; decode
    cannot pad right; the built-in preset has no eager attention - each said, not a failure."""
    seqs = engine.generate_batch(model_dir, "float32", (5, 6), 4)
    s = _rollout(_write(tmp_path, seqs), model_dir, micro_batch=(1,), modes=("prefill", "decode"),
                 fixes=("none",), padding=("auto", "left", "right"))
    c = s["configurations"]
    assert c["tp1-mb1-prefill-none-padleft"]["same_bits_as"] == "tp1-mb1-prefill-none"
    assert c["tp1-mb1-decode-none-padright"]["status"] == "unavailable"
    assert "left" in c["tp1-mb1-decode-none-padright"]["reason"]
    from tpdiag.runner.attention import attention
    from tpdiag.rollout.compute import Unavailable
    from tpdiag.models.tiny_llama import build

    with pytest.raises(Unavailable, match="eager"):
        with attention(build(), "eager", Unavailable):
            pass
