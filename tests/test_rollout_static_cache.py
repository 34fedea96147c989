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

from tests.static_engine import static_rows, write_rows  # noqa: E402
from tests.rl_team import engine, save_bf16  # noqa: E402

STATIC = "tp1-mb8-decode-none-padstatic"
DYNAMIC = "tp1-mb8-decode-none"


def _cli(tmp_path, rows, path, *args):
    from typer.testing import CliRunner

    from tpdiag.cli import app

    f = write_rows(tmp_path / "r.jsonl", rows)
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
    f = write_rows(tmp_path / "e.jsonl", rows)
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
    f = write_rows(tmp_path / "e.jsonl", files["raw"])
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
    # on a GPU generate() compiles a static cache's forward: said, as tpdiag's decode is eager
    from tpdiag.rollout.run import RolloutConfig, _static_note

    assert "--padding static,compiled" in _static_note(RolloutConfig(file="f", device="cuda",
                                                                     padding=("auto", "static")))[0]
    assert _static_note(RolloutConfig(file="f", device="cpu", padding=("auto", "static"))) == []
    assert _static_note(RolloutConfig(file="f", device="cuda")) == []
    assert _static_note(RolloutConfig(file="f", device="cuda", padding=("static", "compiled"))) == []
    assert parse_padding("static,compiled") == ("static", "compiled")
    assert Config(1, 8, "decode", padding="compiled").rollout_name() == "tp1-mb8-decode-none-padcompiled"
    # where nothing reproduced, what is left to try names the compiled decode on a GPU only
    from tpdiag.rollout.todo import _untried

    assert "--padding auto,static,compiled" in _untried(RolloutConfig(file="f", model="hf:x", device="cuda",
                                                                      padding=("auto", "static")), 4)
    assert "compiled" not in _untried(RolloutConfig(file="f", model="hf:x", device="cpu"), 4)


def test_compiled_static_decode_is_refused_where_generate_does_not_compile(tmp_path):
    """generate() compiles a static cache's decode only on a GPU (tests/test_rollout_gpu.py checks
    the bits there): on the CPU `--padding compiled` is not a configuration an engine runs - the
    summary says so, and a --max-cache-len with it alone is its static cache's."""
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"input_ids": [3, 4, 5, 6], "prompt_len": 2, "logprobs": [-1.0, -1.0]}) + "\n")
    s = run_rollout(RolloutConfig(file=str(f), model="tiny-llama", micro_batch=(1,), modes=("decode",),
                                  fixes=("none",), padding=("auto", "compiled"), max_cache_len=8))
    why = s["configurations"]["tp1-mb1-decode-none-padcompiled"]["reason"]
    assert "only on cuda / xpu" in why and "--padding static" in why, why


def _generate_rows(model, new, eos=2):
    return static_rows(model, [eos], max_new_tokens=new, eos_token_id=eos)


def test_an_earlier_longer_generate_sets_the_cache_length(tmp_path):
    """transformers keeps a model's longest static cache (_previous_max_cache_length): a generate()
    after a longer one on the same model attends over the longer cache. --max-cache-len of the
    earlier call's max_length - 1 reproduces it. Whether the default (this batch's own length)
    does depends on the host's SDPA, and generate() itself says which: where it gives other bits
    at each key length (float32 on the EPYC hosts this was written on) the same call on a fresh
    model (its own 17 positions) is other bits, and the default must not reproduce the file; where
    its masked trailing keys add exact zeros in a fixed order (an AVX-512 Xeon's flash kernel) the
    fresh call is the same bits, and so must tpdiag's default be."""
    from transformers import AutoModelForCausalLM

    from tpdiag.rollout.run import RolloutConfig, run_rollout

    path = save_bf16("qwen2", tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _generate_rows(model, new=16)  # an earlier call: cache 8 + 16 - 1 = 23 positions
    rows = _generate_rows(model, new=10)
    assert max(len(x["logprobs"]) for x in rows) == 10
    f = write_rows(tmp_path / "e.jsonl", rows)

    def exact(n):
        s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="float32", micro_batch=(8,),
                                      modes=("decode",), fixes=("none",), padding=("static",), max_cache_len=n))
        m = s["configurations"][STATIC]["metrics"]
        return m["exact_tokens"], m["tokens"]

    got, n = exact(23)
    assert got == n
    # the engine at 17 positions: the same generate() on a fresh model (no earlier, longer cache)
    fresh = _generate_rows(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), new=10)
    length_moves_bits = fresh != rows
    got, n = exact(0)  # 8 + 10 - 1 = 17 positions: not the engine's cache
    assert (got < n) if length_moves_bits else (got == n), (got, n, length_moves_bits)
    from tpdiag.errors import BadInput

    with pytest.raises(BadInput, match="a static KV cache of 12 positions cannot hold a micro-batch's 17"):
        exact(12)


def test_max_cache_len_without_static_padding_is_refused(tmp_path):
    from tpdiag.errors import BadInput
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"input_ids": [3, 4, 5, 6], "prompt_len": 2, "logprobs": [-1.0, -1.0]}) + "\n")
    with pytest.raises(BadInput, match="--max-cache-len 20: the length of --padding static's KV cache"):
        run_rollout(RolloutConfig(file=str(f), model="tiny-llama", max_cache_len=20))


def test_a_static_decode_leak_is_read_against_the_padded_prefill():
    """The batch note for a static decode: prefill has no static cache, so its rounding baselines
    are the padded prefill's (with padding static there is none to read: no note at all)."""
    from tpdiag.base.configs import Config
    from tpdiag.rollout import batch_leak
    from tpdiag.rollout.read import Sequence

    seqs = [Sequence(list(range(3, 13)), 4, [-1.0] * 6, where=f"line {i + 1}") for i in range(4)]
    base = torch.linspace(-3.0, -0.5, 9)
    cfgs = [Config(1, mb, "decode", padding="static") for mb in (4, 1)] + [Config(1, mb, "prefill") for mb in (4, 1)]
    t = {}
    for c in cfgs:
        lp = [base.clone() for _ in seqs]
        lp[0][5] += 1e-3 * (c.micro_batch == 1) + 2e-3 * (c.mode == "decode")  # rounding: one token
        if c.mode == "decode" and c.micro_batch == 4:
            for x in lp[1:]:
                x[3:] += 0.05  # the padded sequences, every token
        t[c.rollout_name()] = lp
    leak = batch_leak.find(cfgs, seqs, t)
    assert leak is not None and leak["configuration"] == "tp1-mb4-decode-none-padstatic", leak
    assert leak["alone"] == "tp1-mb1-decode-none-padstatic" and len(leak["baselines"]) == 2, leak
    assert leak["ratio"] > 10


def _static_batch(model, eos, seed, new=12):
    return static_rows(model, eos, seed=seed, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)


def test_a_batch_that_stopped_at_eos_early_keeps_generates_cache_length(tmp_path):
    """generate(cache_implementation="static", max_new_tokens=12) sizes its cache from max_new_tokens
    whether or not the batch stops early at EOS. Two such calls of 4 (float32, where the CPU's SDPA
    gives other bits at each key length): one whose sequences all stop after 1-4 tokens, one that
    runs to 12. Each --micro-batch 4 is one call; the default length now takes max_new_tokens from
    the whole file (12, from the batch that ran out), and reproduces both - before, the early
    batch's cache was its own 4 steps long (2 of its 10 tokens exact). A file of the early batch
    alone cannot say 12: a note says the length is a lower bound, and --max-new-tokens 12 reproduces
    it."""
    from transformers import AutoModelForCausalLM

    from tpdiag.errors import BadInput
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    path = save_bf16("qwen2", tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    early = _static_batch(model, list(range(2, 60)), seed=0)  # 58 of 256 ids stop it
    late = _static_batch(model, [2], seed=0)
    assert max(len(x["logprobs"]) for x in early) < 12 == max(len(x["logprobs"]) for x in late)

    def run(rows, name, **kw):
        f = write_rows(tmp_path / name, rows)
        got = {}
        s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="float32", micro_batch=(4,),
                                      modes=("decode",), fixes=("none",), padding=("static",), **kw),
                        on_logprobs=got.update)
        return s, got["tp1-mb4-decode-none-padstatic"]

    def exact(rows, lps):
        return [torch.equal(lps[i][x["prompt_len"] - 1:], torch.tensor(x["logprobs"])) for i, x in enumerate(rows)]

    s, lps = run(early + late, "both.jsonl")
    assert all(exact(early + late, lps)), exact(early + late, lps)
    s, lps = run(early, "early.jsonl")  # control: the early batch alone at its own 4 steps is not the engine
    assert not all(exact(early, lps))
    s, lps = run(early, "early.jsonl", max_new_tokens=12)
    assert all(exact(early, lps))
    with pytest.raises(BadInput, match="--max-new-tokens=3: line 1 has 12 generated tokens"):
        run(late, "late.jsonl", max_new_tokens=3)
    with pytest.raises(BadInput, match="--max-new-tokens 12: it sets --padding static's KV cache length"):
        run_rollout(RolloutConfig(file=str(tmp_path / "late.jsonl"), model="hf:" + path, max_new_tokens=12))


def test_the_static_length_note_names_a_file_that_cannot_say_it(tmp_path):
    """Every sequence ending at the model's EOS: the file does not give max_new_tokens, and a note says
    the length taken is the least it can be."""
    from tpdiag.rollout import static_len
    from tpdiag.rollout.read import Sequence
    from tpdiag.rollout.run import RolloutConfig

    class M:
        class generation_config:
            eos_token_id = [2, 7]

    seqs = [Sequence([5, 6, 9, 2], 2, [-1.0, -1.0]), Sequence([5, 6, 9, 4, 7], 2, [-1.0] * 3)]
    rc = RolloutConfig(file="f", modes=("decode",), padding=("static",))
    assert "taken as 3, the least it can be - pass --max-new-tokens N" in static_len.note(rc, seqs, M)[0]
    assert static_len.resolve(rc, seqs) == 3
    assert static_len.note(RolloutConfig(file="f", modes=("decode",), padding=("static",), max_new_tokens=9),
                           seqs, M) == []
    ran_out = seqs + [Sequence([5, 6, 9, 4, 4], 2, [-1.0] * 3)]  # no EOS: it ran to max_new_tokens
    assert static_len.note(rc, ran_out, M) == []
    assert static_len.note(RolloutConfig(file="f", modes=("decode",)), seqs, M) == []
