"""`--padding static` where the engine called generate(cache_implementation="static") without
max_new_tokens: generate() then takes the checkpoint's own generation_config.max_new_tokens (the
cache: the padded prompt + it - 1), else its max_length (a cache of max_length - 1 whatever the
prompt). When every sequence stopped at EOS the file does not say the length; tpdiag took the least
it can be (the most tokens generated), and no configuration reproduced the engine (0 of 11 tokens
here, both settings). It now reads the checkpoint's generation config, as from_pretrained does, and
`tp1-mb4-decode-none-padstatic` is generate()'s own logprobs bit for bit (torch.equal per sequence);
a note names where the length came from. The control: the least length (--max-new-tokens of the
most generated) is not those bits."""

import pytest
import torch

pytest.importorskip("transformers")

from tests.static_engine import static_rows, write_rows  # noqa: E402
from tests.rl_team import save_bf16  # noqa: E402

EOS = list(range(3, 200, 2))  # half the vocabulary: every sequence ends early, at an EOS
STATIC = "tp1-mb4-decode-none-padstatic"


def _engine(path):
    """The user's engine: from_pretrained, one sampled generate(cache_implementation="static") with
    no max_new_tokens over LENS left-padded."""
    from transformers import AutoModelForCausalLM

    return static_rows(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), EOS)


@pytest.mark.parametrize("setting,words", [
    ({"max_new_tokens": 24}, "generation_config max_new_tokens 24"),
    ({"max_length": 30}, "generation_config max_length 30 (a static cache of 29 positions)"),
])
def test_a_static_engine_without_max_new_tokens_takes_the_checkpoints(tmp_path, setting, words):
    from transformers import GenerationConfig

    from tpdiag.rollout.run import RolloutConfig, run_rollout

    path = save_bf16("qwen2", tmp_path / "q")
    GenerationConfig(eos_token_id=EOS, pad_token_id=0, **setting).save_pretrained(path)
    rows = _engine(path)
    most = max(len(x["logprobs"]) for x in rows)
    assert all(x["input_ids"][-1] in EOS for x in rows) and most < 10  # the file does not say the length
    f = write_rows(tmp_path / "e.jsonl", rows)

    def run(**over):
        got = {}
        s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="bfloat16", micro_batch=(4,),
                                      modes=("decode",), fixes=("none",), padding=("static",), **over),
                        on_logprobs=got.update)
        return s, got[STATIC]

    s, lps = run()
    for i, x in enumerate(rows):
        assert torch.equal(lps[i][x["prompt_len"] - 1:], torch.tensor(x["logprobs"], dtype=torch.float32)), i
    assert s["closest"]["reproduced"] and any(words in n for n in s["notes"]), s["notes"]
    # the control: the least length the file allows (what tpdiag took before) is not generate()'s
    s, lps = run(max_new_tokens=most)
    assert not s["closest"]["reproduced"]


def test_a_checkpoints_max_cache_len_sizes_the_static_cache(tmp_path):
    """generate() sizes a static cache max(max_length - 1, generation_config.max_cache_len): a
    checkpoint whose generation config sets max_cache_len 24 attends over 24 positions where the
    batch asks for 17. tpdiag took the batch's own 17 before and takes the checkpoint's 24 now
    (every token), with a note naming it. The control (--max-cache-len 17) is generate()'s own at 17
    positions, whatever the host: where the CPU's SDPA gives other bits at each key length (float32
    on the EPYC hosts this was written on: 34 of 40 by hand) not every token; where masked trailing
    keys add exact zeros in a fixed order (an AVX-512 Xeon's flash kernel) generate() at 17 is the
    same bits, and so every token."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tpdiag.rollout.run import RolloutConfig, run_rollout

    path = save_bf16("qwen2", tmp_path / "q")
    GenerationConfig(eos_token_id=2, pad_token_id=0, max_cache_len=24).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = static_rows(model, [2], max_new_tokens=10, eos_token_id=2)  # the batch's own cache: 8 + 10 - 1 = 17 positions
    f = write_rows(tmp_path / "e.jsonl", rows)

    def run(**over):
        s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="float32", micro_batch=(8,),
                                      modes=("decode",), fixes=("none",), padding=("static",), **over))
        m = s["configurations"]["tp1-mb8-decode-none-padstatic"]["metrics"]
        return s, m["exact_tokens"], m["tokens"]

    s, got, n = run()
    assert got == n and any("generation_config.max_cache_len 24" in x for x in s["notes"]), s["notes"]
    # the engine at 17 positions: the same call on a fresh model (a model keeps its longest static
    # cache) with max_cache_len 17 (a generation_config= without it still took the checkpoint's 24)
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    at17 = static_rows(fresh, [2], max_new_tokens=10, eos_token_id=2, max_cache_len=17)
    length_moves_bits = at17 != rows
    _, got, n = run(max_cache_len=17)
    assert (got < n) if length_moves_bits else (got == n), (got, n, length_moves_bits)


def test_a_broken_generation_config_is_read_as_from_pretrained_reads_it(tmp_path):
    """A checkpoint whose generation_config.json is not JSON: from_pretrained loads the model all the
    same (its generation config then the config.json's own), and so must the static cache's length
    be read - it raised OSError out of `tpdiag rollout --padding static` (a traceback, no run)."""
    from transformers import AutoConfig, GenerationConfig, Qwen2Config

    from tpdiag.rollout import static_len

    Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, eos_token_id=5).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(OSError):  # what the read did before
        GenerationConfig.from_pretrained(tmp_path)
    got = static_len._generation_config(f"hf:{tmp_path}")
    want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp_path))
    assert got.to_dict() == want.to_dict() and got.eos_token_id == 5
