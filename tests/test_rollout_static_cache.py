"""A rollout engine with a static KV cache: transformers' generate(cache_implementation="static")
(TRL's GRPO `cache_implementation="static"`) preallocates the cache to max_length - 1 positions and
every call attends over all of them, the unwritten ones masked. `tpdiag rollout --padding static`
decodes through that cache.

- A tiny Qwen2 saved in bf16, one sampled generate(cache_implementation="static") call over
  left-padded prompts of different lengths: `tp1-mb8-decode-none-padstatic` is generate()'s own
  logprobs (its output_logits) bit for bit, and the CLI names it among the configurations that
  reproduce the engine.
- Negative control: tpdiag's dynamic-cache decode (`tp1-mb8-decode-none`, what reproduces the
  default generate()) is not those bits on this CPU (0 of 80 tokens here): the cache's length is
  the attention's key length, and SDPA's kernel sums over it in another order. Without --padding
  static nothing decoded reproduces the engine, and the summary says to try it.
"""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.test_rollout_rl_team import engine, save_bf16  # noqa: E402

STATIC = "tp1-mb8-decode-none-padstatic"
DYNAMIC = "tp1-mb8-decode-none"


def _cli(tmp_path, rows, path, *args):
    from typer.testing import CliRunner

    from tpdiag.cli import app

    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = CliRunner().invoke(app, ["rollout", str(f), "--model", "hf:" + path, "--dtype", "bfloat16",
                                 "--device", "cpu", "--micro-batch", "8", "--fix", "none", "--format", "json",
                                 *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_static_cache_decode_is_generates_static_logprobs(tmp_path):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    path = save_bf16("qwen2", tmp_path / "q")
    files, _ = engine(path, temperature=1.0, cache_implementation="static")
    rows = files["raw"]
    assert len(rows) == 8 and len({x["prompt_len"] for x in rows}) > 1  # left padding in the engine's batch
    f = tmp_path / "e.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    got = {}
    s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="bfloat16", micro_batch=(8,),
                                  modes=("decode", "prefill"), fixes=("none",), padding=("auto", "static")),
                    on_logprobs=got.update)
    # (1) generate(cache_implementation="static")'s own logprobs (float32 log_softmax of its
    # output_logits, as the engine helper writes them), every generated token bit for bit
    for i, x in enumerate(rows):
        engine_lp = torch.tensor(x["logprobs"], dtype=torch.float32)
        assert torch.equal(got[STATIC][i][x["prompt_len"] - 1:], engine_lp), i
    # (2) the dynamic-cache decode is not the static engine's bits
    assert not all(torch.equal(got[DYNAMIC][i][x["prompt_len"] - 1:], torch.tensor(x["logprobs"]))
                   for i, x in enumerate(rows))
    c = s["configurations"]
    assert c[DYNAMIC]["metrics"]["exact_tokens"] < c[DYNAMIC]["metrics"]["tokens"]
    assert "a prefill call has no cache" in c["tp1-mb8-prefill-none-padstatic"]["reason"]

    # the CLI on the engine's file names the static configuration; without it, decode reproduces
    # nothing and the summary says what to try
    s = _cli(tmp_path, rows, path, "--mode", "decode", "--padding", "auto,static")
    assert s["closest"]["reproduced"] is True and s["closest"]["configurations"] == [STATIC], s["closest"]
    s = _cli(tmp_path, rows, path, "--mode", "decode")
    assert s["closest"]["reproduced"] is False
    assert "--padding auto,static" in s["closest"]["explanation"]
    assert "--padding auto,static" in s["what_to_do"]["line"]


def test_the_static_configuration_does_not_reproduce_the_default_generate(tmp_path):
    """The other direction: the default generate() (DynamicCache) is tpdiag's dynamic decode, and
    the static configuration is not it - the what-to-do line names the cache as the difference."""
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    path = save_bf16("qwen2", tmp_path / "q")
    files, _ = engine(path, temperature=1.0)
    f = tmp_path / "e.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in files["raw"]))
    s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="bfloat16", micro_batch=(8,),
                                  modes=("decode",), fixes=("none",), padding=("static", "auto")))
    c = s["configurations"]
    assert c[DYNAMIC]["metrics"]["exact_tokens"] == c[DYNAMIC]["metrics"]["tokens"]
    assert c[STATIC]["metrics"]["exact_tokens"] < c[STATIC]["metrics"]["tokens"]
    assert s["closest"]["configurations"] == [DYNAMIC]
    assert "through a static KV cache" in s["what_to_do"]["line"], s["what_to_do"]["line"]


def test_padding_static_is_parsed_and_named():
    from tpdiag.base.configs import Config, parse
    from tpdiag.errors import BadInput
    from tpdiag.rollout.options import parse_padding

    assert parse_padding("auto,static") == ("auto", "static")
    c = Config(1, 8, "decode", padding="static")
    assert c.rollout_name() == STATIC and parse(STATIC) == c
    with pytest.raises(BadInput, match="static: decode through a static KV cache"):
        parse_padding("statik")
