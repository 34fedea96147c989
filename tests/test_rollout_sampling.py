"""`tpdiag rollout --sampling`: generate()'s processed scores (output_scores) reproduced bit for bit by
processing the trainer's logits with generate()'s own processors. Before it, a repetition penalty
read 'systematic ... not modelled here' and min_p was not modelled at all; a rollout sampled at
temperature 0.7 alone read as a filter too, since generate() adds top_k=50 unless told otherwise."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.conftest import run_cli  # noqa: E402
from tests.test_rollout_generate_zoo import _write  # noqa: E402
from tests.test_rollout_processed import _engine  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _write("llama", tmp_path_factory.mktemp("samp") / "llama", rope_theta=500000.0)


def _run(tmp_path, rows, model, **over):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    kw = dict(file=str(f), model="hf:" + model, micro_batch=(4,), modes=("decode",), fixes=("none",))
    return run_rollout(RolloutConfig(**{**kw, **over}))


def _scores(path, **sample):
    """generate()'s output_scores over 4 left-padded prompts, 8 tokens each, sampled with `sample`
    alone (generate()'s defaults for the rest)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path).eval()
    m.generation_config.eos_token_id = None  # no EOS: every sequence 8 tokens, no min-length processor
    g = torch.Generator().manual_seed(1)
    lens, P = (5, 8, 6, 7), 8
    ids, mask = torch.zeros(4, P, dtype=torch.long), torch.zeros(4, P, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, P - n:] = torch.randint(3, 128, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(1)
    res = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                     output_scores=True, return_dict_in_generate=True, pad_token_id=0, **sample)
    return [{"input_ids": res.sequences[r, P - n:].tolist(), "prompt_len": n,
             "logprobs": [float(torch.log_softmax(s[r], -1)[res.sequences[r, P + j]])
                          for j, s in enumerate(res.scores)]}
            for r, n in enumerate(lens)]


def test_a_repetition_penalty_alone_is_reproduced_bit_for_bit(tmp_path, model):
    # the penalty reads each row's tokens so far (its left padding left out, as generate() does)
    # (the engine passed top_k=0: generate() adds top_k=50 where it is not given)
    rows = _engine(model, scores=True, repetition_penalty=1.3)
    s = _run(tmp_path, rows, model, sampling=(("repetition_penalty", 1.3), ("top_k", 0)))
    assert s["metrics"]["exact_tokens"] == s["metrics"]["tokens"] == 32 and s["closest"]["reproduced"] is True
    assert s["sampling"]["processors"] == "repetition_penalty=1.3"
    # controls: another penalty, and none (what tpdiag compared before)
    s = _run(tmp_path, rows, model, sampling=(("repetition_penalty", 1.2), ("top_k", 0)))
    assert s["metrics"]["exact_tokens"] < 32 and s["closest"]["reproduced"] is False
    s = _run(tmp_path, rows, model)
    assert s["metrics"]["exact_tokens"] < 32 and s["closest"]["reproduced"] is False


def test_generates_default_top_k_is_applied_and_named(tmp_path, model):
    rows = _scores(model, temperature=0.7)
    s = _run(tmp_path, rows, model, sampling=(("temperature", 0.7),))
    assert s["closest"]["reproduced"] is True, s["metrics"]
    assert s["sampling"]["processors"] == ("temperature=0.7, top_k=50 (not in --sampling: generate()'s default for "
                                           "this checkpoint)")
    # control: temperature alone, without the default top-k, is not the engine's scores
    s = _run(tmp_path, rows, model, sampling=(("temperature", 0.7), ("top_k", 0)))
    assert s["closest"]["reproduced"] is False


def test_min_p_with_the_fixes_at_tp2_gives_tp1s_bits(tmp_path, model):
    # the processors read whole rows: at TP=2 the vocab-sharded logits are gathered first, and under
    # the fixes the processed logprobs are TP=1's bit for bit
    rows = _engine(model, scores=True, min_p=0.05, temperature=0.9)
    s = _run(tmp_path, rows, model, tp=(1, 2), modes=("prefill",), fixes=("all",),
             sampling=(("temperature", 0.9), ("top_k", 0), ("min_p", 0.05)))
    assert s["configurations"]["tp2-mb4-prefill-all"]["status"] == "ok"
    assert s["configurations"]["tp2-mb4-prefill-all"]["same_bits_as"] == "tp1-mb4-prefill-all"
    assert s["tp_invariance"]["tp2-mb4-prefill-all"]["same_bits"] is True


def test_bad_sampling_is_one_line_exit_2(tmp_path, model):
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in _engine(model)))
    for arg, says in (("temp=0.8", "'temp=0.8' is not NAME=VALUE with NAME one of temperature"),
                      ("top_k=abc", "top_k='abc' is not an integer"),
                      ("top_p=0.9,top_p=0.8", "top_p is given twice"),
                      ("temperature=-1", "transformers refuses these settings")):
        p = run_cli("rollout", str(f), "--model", "hf:" + model, "--micro-batch", "4", "--mode", "decode",
                    "--fix", "none", "--sampling", arg)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, (arg, p.stderr)
    p = run_cli("rollout", str(f), "--model", "tiny-llama", "--micro-batch", "4", "--sampling", "temperature=0.8")
    assert p.returncode == 2 and "--sampling applies transformers' generate() processors" in p.stderr, p.stderr


def test_parse():
    from tpdiag.errors import BadInput
    from tpdiag.rollout.sampling import parse

    assert parse("none") == () and parse("") == ()
    assert parse(" temperature=0.8, top-k=40 ,min_p=0.02") == (("temperature", 0.8), ("top_k", 40), ("min_p", 0.02))
    with pytest.raises(BadInput, match="frequency_penalty"):
        parse("frequency_penalty=0.5")


def test_a_token_the_filters_removed_is_left_out_and_named():
    # a prefill whose logits differ from the engine's by rounding can put a sampled token past a
    # top_p/min_p edge: its processed logprob is -inf. It failed the whole configuration ("a kernel
    # of this configuration produced them") and, where every configuration did, the run
    import math

    from tpdiag.rollout.metrics import non_finite, reproduces, summarise
    from tpdiag.rollout.read import Sequence

    seqs = [Sequence([5, 1, 2, 3], 1, [-0.5, -1.0, -2.0], where="line 1")]
    trainer = [torch.tensor([-0.5, -math.inf, -2.0])]
    m = summarise(seqs, trainer, sampled=True)
    assert m["tokens"] == 2 and m["exact_tokens"] == 2 and m["filtered_out"]["tokens"] == 1
    assert "line 1, position 2" in m["filtered_out"]["line"] and not reproduces(seqs, m)
    assert non_finite(seqs, trainer, sampled=True) is None
    assert "a kernel of this configuration" in non_finite(seqs, trainer)  # raw logprobs: -inf is a kernel's
    everything = [torch.full((3,), -math.inf)]
    assert non_finite(seqs, everything, sampled=True).startswith("every generated token: --sampling's filters")
