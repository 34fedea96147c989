"""A new user's rollout file that kept generate()'s left padding in `input_ids` (its `sequences` rows,
padded to the longest prompt): tpdiag ran the pad tokens as prompt, nothing reproduced the engine,
token_mult_prob_error read over NeMo RL's 1.05 and the advice pointed at the engine's own kernels.
A note now names the sequences that begin with the pad token and what to write; the same rollout
written with each sequence's own tokens reproduces the engine and says nothing of padding."""
import json

import pytest
import torch

pytest.importorskip("transformers")

LENS, NEW = (3, 5), 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(model dir, padded file, own-tokens file): a bf16 checkpoint and one sampled generate() over
    two left-padded prompts, each chosen token's logprob from output_logits."""
    from hf_configs import save_tiny_bf16_llama
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("padded")
    path = save_tiny_bf16_llama(d / "model")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    pad = model.generation_config.eos_token_id  # no pad token: generate() pads with the EOS
    P = max(LENS)
    ids = torch.full((len(LENS), P), pad, dtype=torch.long)
    mask = torch.zeros(len(LENS), P, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    for r, n in enumerate(LENS):
        ids[r, P - n:] = torch.randint(3, 64, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(1)
    res = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                         top_k=0, top_p=1.0, temperature=1.0, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=pad)
    padded, own = [], []
    for r, n in enumerate(LENS):
        seq = res.sequences[r].tolist()
        lps = [float(torch.log_softmax(s[r].float(), -1)[seq[P + j]]) for j, s in enumerate(res.logits)]
        padded.append({"input_ids": seq, "prompt_len": P, "logprobs": lps})  # the mistake
        own.append({"input_ids": seq[P - n:], "prompt_len": n, "logprobs": lps})
    files = []
    for name, rows in (("padded.jsonl", padded), ("own.jsonl", own)):
        (d / name).write_text("".join(json.dumps(x) + "\n" for x in rows))
        files.append(str(d / name))
    return (path, *files)


def _run(model, f):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    return run_rollout(RolloutConfig(file=f, model="hf:" + model, micro_batch=(2,), modes=("decode",),
                                     fixes=("none",), dtype="bfloat16", top=0))


def test_left_padding_kept_in_the_file_is_named(engine):
    model, padded, own = engine
    s = _run(model, padded)
    assert not s["closest"]["reproduced"]
    pads = [n for n in s["notes"] if "begin with the model's pad token" in n]
    assert len(pads) == 1 and "1 of 2 sequences" in pads[0] and "line 1: 2" in pads[0], s["notes"]
    assert s["what_to_do"]["case"] == "none"
    assert s["what_to_do"]["line"].split(". ")[1].startswith(
        "First write the sequences without the engine's left padding"), s["what_to_do"]["line"]
    # control: the same tokens and logprobs without the padding reproduce the engine, no note
    s = _run(model, own)
    assert s["closest"]["reproduced"] and s["what_to_do"]["case"] == "nothing"
    assert not [n for n in s["notes"] if "pad token" in n] and "padding" not in s["what_to_do"]["line"]


def test_a_bos_that_is_the_pad_token_is_not_padding():
    from tpdiag.rollout.padded import leading_pads
    from tpdiag.rollout.read import Sequence

    seqs = [Sequence([7, 7, 7, 4, 5], 4, [-1.0], where="line 1"), Sequence([7, 4, 5], 2, [-1.0], where="line 2"),
            Sequence([4, 7, 5], 2, [-1.0], where="line 3")]
    assert leading_pads(seqs, pad=7, bos=1) == [("line 1", 3), ("line 2", 1)]
    assert leading_pads(seqs, pad=7, bos=7) == [("line 1", 2)]  # the first 7 may be the prompt's BOS


def test_a_micro_batch_over_the_batch_is_the_engines_one_call():
    # the default --micro-batch 8,1 on 4 sequences already runs them in one call (the same bits as
    # --micro-batch 4): the `none` case suggested --micro-batch 4 as untried
    from tpdiag.rollout.run import RolloutConfig
    from tpdiag.rollout.todo import _untried

    assert "--micro-batch" not in _untried(RolloutConfig(file="f", micro_batch=(8, 1)), 4)
    assert "--micro-batch 4 (the engine's batch" in _untried(RolloutConfig(file="f", micro_batch=(2, 1)), 4)


def test_a_trainer_degree_alone_is_told_to_try_tp1(engine):
    # `--tp 2` alone (the trainer's production degree): the untried settings did not name TP=1,
    # and the TP note said TP=1 had run in this process
    from tpdiag.rollout.run import RolloutConfig, run_rollout
    from tpdiag.rollout.todo import _untried

    assert _untried(RolloutConfig(file="f", tp=(2,), micro_batch=(8,)), 4).startswith(
        "--tp 2,1 (your degree stays the reference; TP=1 is what generate()")
    assert "--tp" not in _untried(RolloutConfig(file="f", tp=(2, 1), micro_batch=(8,)), 4)
    # the built-in model at TP=2 (the tiny checkpoint's one KV head does not split): another model than
    # the engine's, so nothing reproduces it - the lines are what is checked
    s = run_rollout(RolloutConfig(file=engine[2], model="tiny-llama", tp=(2,), micro_batch=(2,), modes=("prefill",),
                                  fixes=("none",), top=0))
    tp = [n for n in s["notes"] if n.startswith("TP > 1 ran in worlds")]
    assert tp == ["TP > 1 ran in worlds of one process per rank, one thread each (as compare's)"], s["notes"]
    assert s["what_to_do"]["case"] == "none" and "--tp 2,1 (your degree stays the reference" in s["what_to_do"]["line"]
    # the processed-logprobs check reads a TP=1 configuration's logits: it said "no configuration ran"
    assert s["processed"]["detected"] is None
    assert s["processed"]["explanation"].startswith("not judged: it reads the trainer's logits in a TP=1 "
                                                     "configuration and --tp has no 1; add 1 to --tp"), s["processed"]
    import io

    from rich.console import Console

    from tpdiag.cli.rollout import rollout_report

    buf = io.StringIO()
    rollout_report(Console(file=buf, width=200), s)
    assert "raw or processed logprobs: not judged" in buf.getvalue()


def test_one_reason_is_printed_once_for_every_configuration_it_stops():
    # gemma2 has no SDPA in transformers: `--attention eager,sdpa --tp 1,2 --mode decode,prefill`
    # printed transformers' paragraph once per sdpa configuration (4 times)
    import io

    from rich.console import Console

    from tpdiag.cli.rollout import rollout_report

    why = "attention sdpa: transformers cannot set it for Gemma2ForCausalLM: no SDPA yet"
    ok = {"status": "ok", "seconds": 0.1, "same_bits_as": None,
          "metrics": {"token_mult_prob_error": 1.0, "max_abs": 0.0, "mean_diff": 0.0, "k3_kl": 0.0,
                      "exact_tokens": 4, "tokens": 4}}
    confs = {"tp1-mb4-decode-none-eager": ok,
             "tp1-mb4-decode-none-sdpa": {"status": "unavailable", "reason": why, "seconds": 0.0},
             "tp2-mb4-decode-none-sdpa": {"status": "unavailable", "reason": why, "seconds": 0.0},
             "tp2-mb4-prefill-none-sdpa": {"status": "failed", "reason": "RuntimeError: boom", "seconds": 0.0}}
    s = {"file": "f", "format": "jsonl", "sequences": 1, "generated_tokens": 4, "model": "hf:m",
         "dtype": "bfloat16", "device": "cpu", "reference": "tp1-mb4-decode-none-eager",
         "metrics": ok["metrics"], "processed": {"detected": False, "explanation": "x"},
         "configurations": confs, "closest": {"configurations": ["tp1-mb4-decode-none-eager"],
                                              "reproduced": True, "explanation": "y"},
         "worst_tokens": [], "notes": []}
    buf = io.StringIO()
    rollout_report(Console(file=buf, width=300), s)
    out = buf.getvalue()
    assert out.count(why) == 1, out
    assert f"tp1-mb4-decode-none-sdpa, tp2-mb4-decode-none-sdpa unavailable: {why}" in out
    assert "tp2-mb4-prefill-none-sdpa failed: RuntimeError: boom" in out
