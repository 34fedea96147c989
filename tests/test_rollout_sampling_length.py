"""`tpdiag rollout --sampling` for the generate() settings that read the step or the tokens so far
beyond the filters: min_new_tokens (EOS banned for the first N steps), bad_words_ids, sequence_bias,
forced_eos_token_id (EOS forced at the last step: needs generate()'s max_new_tokens). Each is
reproduced bit for bit against generate()'s output_scores, and each left out of --sampling is not
(the negative controls); forced_eos_token_id without max_new_tokens is refused in one line, exit 2,
whether it comes from --sampling or from the checkpoint's generation_config."""
import json

import pytest

pytest.importorskip("transformers")

from tests.conftest import run_cli  # noqa: E402
from tests.rl_team import engine, rollout, save_bf16  # noqa: E402

BASIC = (("temperature", 0.8), ("top_k", 40))
LENGTH = (("min_new_tokens", 4), ("bad_words_ids", ((5,), (7, 8))), ("sequence_bias", (((9,), -3.0), ((10, 11), 2.0))),
          ("forced_eos_token_id", 2), ("max_new_tokens", 10))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_bf16("llama", tmp_path_factory.mktemp("len") / "llama")


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


def _generate(path, settings):
    """generate()'s output_scores rows, sampled with `settings` (max_new_tokens is the engine's 10)."""
    kw = {k: _plain(v) for k, v in settings if k != "max_new_tokens"}
    files, _ = engine(path, **kw)
    return files["scores"]


def test_length_and_word_settings_are_reproduced_and_each_one_matters(tmp_path, ckpt):
    rows = _generate(ckpt, BASIC + LENGTH)
    n = sum(len(x["logprobs"]) for x in rows)
    new = [x["input_ids"][x["prompt_len"]:] for x in rows]
    assert min(len(t) for t in new) >= 4 and any(len(t) == 10 and t[-1] == 2 for t in new), new
    s, _ = rollout(tmp_path, rows, ckpt, modes=("decode",), sampling=BASIC + LENGTH)
    m = s["metrics"]
    assert m["exact_tokens"] == m["tokens"] == n and s["closest"]["reproduced"] is True, m
    assert s["sampling"]["processors"] == (
        "sequence_bias, bad_words_ids, min_new_tokens=4, forced_eos_token_id=[2], temperature=0.8, top_k=40")
    # negative controls: each setting left out is another distribution at some generated token (a
    # forced EOS that top_k then filters out is counted apart, as filtered_out: not exact either)
    for left in ("min_new_tokens", "bad_words_ids", "sequence_bias", "forced_eos_token_id"):
        rest = tuple(kv for kv in BASIC + LENGTH if kv[0] != left)
        s, _ = rollout(tmp_path, rows, ckpt, modes=("decode",), sampling=rest)
        m = s["metrics"]
        assert m["exact_tokens"] < n and s["closest"]["reproduced"] is False, (left, m)


def _cli(path, rows_file, sampling):
    return run_cli("rollout", str(rows_file), "--model", "hf:" + path, "--micro-batch", "8", "--mode", "decode",
                   "--fix", "none", "--dtype", "bfloat16", "--sampling", sampling)


def test_what_cannot_be_reproduced_is_refused_in_one_line(tmp_path, ckpt):
    rows = _generate(ckpt, BASIC)
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    for arg, says in (("temperature=0.8,forced_eos_token_id=2", "forced_eos_token_id (--sampling) makes generate() "
                                                                "force EOS at its last step"),
                      ("bad_words_ids=[5]", "bad_words_ids='[5]' is not a JSON list of token-id lists"),
                      ("sequence_bias=[[5,-1.0]]", "sequence_bias='[[5,-1.0]]' is not a JSON list of [token-id list"),
                      ("temperature=0.8,max_new_tokens=3", "max_new_tokens=3: line 1 has")):
        p = _cli(ckpt, f, arg)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, (arg, p.stderr)
    # the checkpoint's own generation_config forcing EOS: refused too (generate() merged it in)
    import shutil

    other = tmp_path / "forced"
    shutil.copytree(ckpt, other)
    gen = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**gen, "forced_eos_token_id": 2}))
    p = _cli(str(other), f, "temperature=0.8,top_k=40")
    assert p.returncode == 2 and "forced_eos_token_id (2, the checkpoint's generation_config)" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    # and its own min_length: counted with generate()'s padded batch prompt, which the file does not give
    (other / "generation_config.json").write_text(json.dumps({**gen, "min_length": 12}))
    p = _cli(str(other), f, "temperature=0.8,top_k=40")
    assert p.returncode == 2 and "min_length=12 (the checkpoint's generation_config)" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_parse_list_values():
    from tpdiag.rollout.sampling import parse

    assert parse("bad_words_ids=[[5],[7,8]], temperature=0.8,eos_token_id=[2,3]") == (
        ("bad_words_ids", ((5,), (7, 8))), ("temperature", 0.8), ("eos_token_id", (2, 3)))
    assert parse("sequence_bias=[[[9],-3],[[10,11],2.5]],min_new_tokens=4") == (
        ("sequence_bias", (((9,), -3.0), ((10, 11), 2.5))), ("min_new_tokens", 4))


def test_the_checkpoints_generation_config_is_what_generate_merges_in(tmp_path, ckpt):
    # a checkpoint shipping sampling defaults in generation_config.json (as Qwen3's: temperature 0.6,
    # top_k 20): generate() takes them for every setting the call does not name. tpdiag built the
    # model from config.json alone and sampled with the config's defaults (top_k=50)
    import shutil

    own = tmp_path / "own"
    shutil.copytree(ckpt, own)
    gen = json.loads((own / "generation_config.json").read_text())
    (own / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_k": 20}))
    rows = _generate(str(own), (("top_p", 0.95),))
    s, _ = rollout(tmp_path, rows, str(own), modes=("decode",), sampling=(("top_p", 0.95),))
    assert s["metrics"]["exact_tokens"] == s["metrics"]["tokens"] and s["closest"]["reproduced"] is True
    assert s["sampling"]["processors"] == (
        "temperature=0.6 (not in --sampling: generate()'s default for this checkpoint), top_k=20 (not in "
        "--sampling: generate()'s default for this checkpoint), top_p=0.95")
    # negative control: the checkpoint without those defaults is another sampler
    s, _ = rollout(tmp_path, rows, ckpt, modes=("decode",), sampling=(("top_p", 0.95),))
    assert s["closest"]["reproduced"] is False
