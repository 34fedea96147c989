"""A new user's model directory whose generation config turns the KV cache off (helper hnew15:
examples/make_tiny_hf.py writes `use_cache: false`). generate() then recomputes the whole batch at
every new token, which no rollout configuration does; nothing reproduced the engine and the advice
pointed at the engine's own kernels. A note now names the file that turns the cache off and what to
do; the same generate() with use_cache=True is `--mode decode` bit for bit and says nothing of it."""
import json

import pytest
import torch

pytest.importorskip("transformers")

LENS, NEW = (3, 5), 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(model dir, file sampled without a KV cache, file sampled with one): the tiny llama of
    examples/make_tiny_hf.py with --weights, its generation_config.json saved with use_cache false
    (as make_tiny_hf.py's was before: save_pretrained copied it from config.json)."""
    from hf_configs import write_tiny, write_weights
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("nocache")
    path = write_tiny("llama", d / "model")[3:]
    write_weights(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.generation_config.use_cache is True  # the example's own: generate() as engines run
    model.generation_config.use_cache = False
    model.generation_config.save_pretrained(path)
    pad = 0
    P = max(LENS)
    ids = torch.full((len(LENS), P), pad, dtype=torch.long)
    mask = torch.zeros(len(LENS), P, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    for r, n in enumerate(LENS):
        ids[r, P - n:] = torch.randint(3, 512, (n,), generator=g)
        mask[r, P - n:] = 1
    files = []
    for name, kw in (("off.jsonl", {}), ("on.jsonl", {"use_cache": True})):
        torch.manual_seed(1)
        res = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                             top_k=0, top_p=1.0, temperature=1.0, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=pad, **kw)
        rows = []
        for r, n in enumerate(LENS):
            seq = res.sequences[r].tolist()
            lps = [float(torch.log_softmax(s[r].float(), -1)[seq[P + j]]) for j, s in enumerate(res.logits)]
            rows.append({"input_ids": seq[P - n:], "prompt_len": n, "logprobs": lps})
        (d / name).write_text("".join(json.dumps(x) + "\n" for x in rows))
        files.append(str(d / name))
    return (path, *files)


def _run(model, f, recipe=None):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    return run_rollout(RolloutConfig(file=f, model="hf:" + model, micro_batch=(2,), modes=("decode",),
                                     fixes=("none",), dtype="float32", top=0, recipe=recipe))


def test_generate_without_a_kv_cache_is_named(engine):
    model, off, on = engine
    s = _run(model, off)
    assert not s["closest"]["reproduced"]
    said = [n for n in s["notes"] if "use_cache false" in n]
    assert len(said) == 1 and "generation_config.json" in said[0], s["notes"]
    assert s["what_to_do"]["line"].split(". ")[1].startswith(
        "First sample again with generate(..., use_cache=True)"), s["what_to_do"]["line"]
    # control: the same generate() with its cache on is --mode decode bit for bit, and no note
    s = _run(model, on)
    assert s["closest"]["reproduced"] and s["what_to_do"]["case"] == "nothing"
    assert not [n for n in s["notes"] if "use_cache" in n] and "use_cache" not in s["what_to_do"]["line"]


def test_which_file_turns_the_cache_off(tmp_path):
    from tpdiag.rollout.no_cache import cache_off

    (tmp_path / "config.json").write_text(json.dumps({"use_cache": False}))
    assert cache_off(str(tmp_path)) == "config.json"  # no generation config: made from config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert cache_off(str(tmp_path)) is None  # its own: transformers' default, the cache on
    (tmp_path / "generation_config.json").write_text(json.dumps({"use_cache": False}))
    assert cache_off(str(tmp_path)) == "generation_config.json"
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"use_cache": False}}))
    assert cache_off(str(tmp_path)) == "config.json"


def test_a_trainer_recipe_leads_before_the_cache(engine):
    """The trainer's own recipe (a temperature the engine's raw logprobs lack) stops every
    configuration by itself: what to do leads with the temperature mismatch (session 25, hrl25:
    rollout/temperature_match.py - the engine's logprobs are at 1, the trainer's at 0.7), then running
    without the recipe, and the cache is no lead."""
    from tpdiag.runner.recipe import Recipe

    model, off, on = engine
    s = _run(model, off, Recipe(name="logsumexp", temperature=0.7))
    assert not s["closest"]["reproduced"]
    assert not [n for n in s["notes"] if "use_cache" in n], s["notes"]
    line = s["what_to_do"]["line"]
    lead = line.split(". ")[1]
    assert lead.startswith("First make the engine's and the trainer's temperatures one"), line
    assert "then run without --logprob/--trainer-temperature/--compiled" in lead, line
    assert "use_cache" not in line.split("then try the settings")[0], line
