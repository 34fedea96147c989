"""An RL team's own torchtitan-style model (tests/models/tt_llama.py: forward(tokens), complex
freqs_cis, GQA through F.scaled_dot_product_attention, no KV cache) under `tpdiag rollout`, its
engine a sampler that recomputes the whole prefix for every token:

- tpdiag's TP=1 prefill is the user's own forward bit for bit, one sequence per call and on the
  right-padded batch; decode is `unavailable`, naming why;
- nothing reproduces the engine, and `what to do:` lists settings to try. It listed
  `--attention eager,sdpa`, which such a model cannot take (eager is only hf: models' to switch:
  `unavailable`; sdpa is what auto runs); it now names the SDPA backends, and they run. With
  prefill alone it also listed `--mode decode`, which such a model cannot run; no longer."""
import json
import os

import pytest
import torch

from conftest import ROOT

SPEC = "py:" + os.path.join(ROOT, "tests", "models", "tt_llama.py") + ":target"


@pytest.fixture(scope="module")
def user():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tt_llama_user", os.path.join(ROOT, "tests", "models", "tt_llama.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build().eval()


def _engine(model, path):
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in (5, 8, 6, 7):
        ids = torch.randint(0, 256, (1, n), generator=g)
        lps = []
        with torch.no_grad():
            for _ in range(6):
                lp = model(ids)[0, -1].float().log_softmax(-1)
                t = torch.multinomial(lp.exp(), 1, generator=g)
                lps.append(lp[t].item())
                ids = torch.cat([ids, t[None]], 1)
        rows.append({"input_ids": ids[0].tolist(), "prompt_len": n, "logprobs": lps})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _run(path, **over):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    got = {}
    kw = dict(file=str(path), model=SPEC, micro_batch=(4, 1), modes=("prefill", "decode"), fixes=("none",))
    return run_rollout(RolloutConfig(**{**kw, **over}), on_logprobs=got.update), got


def test_a_torchtitan_style_trainer_is_the_users_forward_and_the_advice_runs(tmp_path, user):
    f = tmp_path / "r.jsonl"
    rows = _engine(user, f)
    s, got = _run(f)
    c = s["configurations"]
    assert c["tp1-mb4-decode-none"]["status"] == "unavailable" and "KV cache" in c["tp1-mb4-decode-none"]["reason"]
    L = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
    with torch.no_grad():
        batch = user(ids).float().log_softmax(-1)
    for i, r in enumerate(rows):
        x = torch.tensor([r["input_ids"]])
        nxt = x[0, 1:, None]
        with torch.no_grad():
            one = user(x)[0, :-1].float().log_softmax(-1).gather(-1, nxt)[:, 0]
        assert torch.equal(one, got["tp1-mb1-prefill-none"][i]), i
        assert torch.equal(batch[i, :len(r["input_ids"]) - 1].gather(-1, nxt)[:, 0], got["tp1-mb4-prefill-none"][i]), i
    # the engine recomputed each prefix: no configuration is it, and the advice names what to try
    assert s["closest"]["reproduced"] is False and s["what_to_do"]["case"] == "none"
    line = s["what_to_do"]["line"]
    assert "--attention eager" not in line and "--attention auto,sdpa-math,sdpa-flash" in line, line
    # what it names runs on this model (eager would be unavailable)
    s, _ = _run(f, modes=("prefill",), micro_batch=(1,), attention=("auto", "sdpa-math", "sdpa-flash"))
    assert all(e["status"] == "ok" for e in s["configurations"].values()), s["configurations"]
    # prefill alone: decode is not named either, which this model cannot run (it was: unavailable)
    assert s["what_to_do"]["case"] == "none" and "--mode decode" not in s["what_to_do"]["line"], s["what_to_do"]
    s, _ = _run(f, modes=("prefill",), micro_batch=(1,), attention=("auto", "eager"))
    assert s["configurations"]["tp1-mb1-prefill-none-eager"]["status"] == "unavailable"


def test_an_hf_model_is_still_told_eager_and_sdpa():
    from tpdiag.rollout.run import RolloutConfig
    from tpdiag.rollout.todo import _untried

    assert "--attention eager,sdpa" in _untried(RolloutConfig(file="f", model="hf:/some/dir"), 4)
    assert "--attention eager" not in _untried(RolloutConfig(file="f", model="tiny-llama"), 4)
    prefill = RolloutConfig(file="f", model="tiny-llama", modes=("prefill",))
    assert "--mode decode" in _untried(prefill, 4) and "--mode decode" not in _untried(prefill, 4, False)


def test_an_hf_model_without_sdpa_is_not_told_eager_and_sdpa(tmp_path):
    # Gemma2 (transformers 5.24: no SDPA path, `--attention auto` runs eager): a run that reproduced
    # nothing said "try ... --attention eager,sdpa", which gives auto's bits again and `unavailable`
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from tpdiag.rollout.run import RolloutConfig
    from tpdiag.rollout.todo import _untried

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, vocab_size=64)
    for kind in ("gemma2", "mistral"):
        AutoConfig.for_model(kind, **small).save_pretrained(tmp_path / kind)
    assert "--attention" not in _untried(RolloutConfig(file="f", model=f"hf:{tmp_path / 'gemma2'}"), 4)
    # control: a model with SDPA is still told both
    assert "--attention eager,sdpa" in _untried(RolloutConfig(file="f", model=f"hf:{tmp_path / 'mistral'}"), 4)
