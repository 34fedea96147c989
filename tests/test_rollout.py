"""`tpdiag rollout` against a real engine: transformers' generate() with its KV cache samples
from a tiny hf: llama and writes the engine's logprobs (examples/hf_rollout.py); tpdiag reads
them and recomputes the trainer's."""
import importlib.util
import json
import math
import os

import pytest

from tests.conftest import run_cli

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tpdiag_example_hf_rollout",
                                               os.path.join(ROOT, "examples", "hf_rollout.py"))
engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return engine.write_all(str(tmp_path_factory.mktemp("rollout")), n=3, new_tokens=6, top_k=4)


def _rollout(path, model, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    return run_rollout(RolloutConfig(file=path, model="hf:" + model, **kw))


def _independent(files):
    """The trainer's logprobs at micro-batch 1, prefill, stock - from transformers directly, and
    the metrics from them in float64 with plain Python."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32).eval()
    d, margins = [], {}
    with torch.no_grad():
        for i, (ids, p, lps, _) in enumerate(files["sequences"]):
            rows = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
            d += [lp - float(rows[p + j - 1, ids[p + j]]) for j, lp in enumerate(lps)]
            top2 = rows.double().topk(2, -1).values
            margins.update({(i, t + 1): float(top2[t, 0] - top2[t, 1]) for t in range(len(ids) - 1)})
    n = len(d)
    return margins, {"tokens": n, "token_mult_prob_error": sum(math.exp(abs(x)) for x in d) / n,
            "max_abs": max(abs(x) for x in d), "mean_diff": sum(d) / n,
            "k3_kl": sum(math.exp(-x) - 1 + x for x in d) / n}


def test_decode_matches_generate_and_metrics_are_exact(files):
    s = _rollout(files["jsonl"], files["model"], micro_batch=(1,), modes=("prefill", "decode"),
                 fixes=("none",))
    cfgs = s["configurations"]
    assert s["format"] == "jsonl" and s["generated_tokens"] == 18
    # generate() runs stock kernels through its KV cache: the trainer's decode, stock, is the
    # engine's numbers bit for bit (--fix all is not: it changes the kernels - docs/rl.md)
    dec = cfgs["tp1-mb1-decode-none"]["metrics"]
    assert dec["exact_tokens"] == 18 and dec["token_mult_prob_error"] == 1.0 and dec["max_abs"] == 0.0
    assert s["closest"]["configurations"] == ["tp1-mb1-decode-none"]
    # negative control: prefill computes the same logprobs in other GEMM shapes - not bitwise
    pre = cfgs["tp1-mb1-prefill-none"]["metrics"]
    assert pre["exact_tokens"] < 18 and pre["max_abs"] > 0
    assert pre["token_mult_prob_error"] > 1.0
    margins, want = _independent(files)
    for k, v in want.items():
        assert pre[k] == pytest.approx(v, rel=1e-12, abs=1e-18), k
    assert s["metrics"] == pre  # the reference is the first configuration
    # the worst tokens carry the trainer's top-2 margin at their position
    w = s["worst_tokens"][0]
    assert abs(w["diff"]) == pre["max_abs"]
    for w in s["worst_tokens"]:
        assert w["top2_margin"] == pytest.approx(margins[(w["sequence"], w["position"])], abs=1e-5)
        assert w["near_tie"] == (w["top2_margin"] <= max(1e-3, 2 * pre["max_abs"]))
    assert s["processed"]["detected"] is False


def test_vllm_and_sglang_files_read_as_the_same_tokens(files, tmp_path):
    from tpdiag.rollout.read import read_rollout

    base = read_rollout(files["jsonl"]).sequences
    for fmt in ("vllm", "sglang"):
        r = read_rollout(files[fmt])
        assert r.format == fmt
        assert [(q.input_ids, q.prompt_len, q.logprobs) for q in r.sequences] == \
               [(q.input_ids, q.prompt_len, q.logprobs) for q in base]
        assert [q.prompt_logprobs for q in r.sequences] == [x[3] for x in files["sequences"]]
    # a /v1/completions response with return_tokens_as_token_ids: ids spelled 'token_id:N'
    ids, p, lps, plp = files["sequences"][0]
    comp = tmp_path / "completions.json"
    comp.write_text(json.dumps({"prompt_token_ids": ids[:p], "choices": [{"text": "", "logprobs": {
        "tokens": [f"token_id:{t}" for t in ids[p:]], "token_logprobs": lps,
        "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids[p:], lps)]}}]}))
    (q,) = read_rollout(str(comp)).sequences
    assert (q.input_ids, q.prompt_len, q.logprobs, q.top[0]) == (ids, p, lps, [(ids[p], lps[0])])
    s = _rollout(files["sglang"], files["model"], micro_batch=(3,), modes=("prefill",), fixes=("none",))
    # the engine's prompt logprobs come from a prefill too: the same numbers as the trainer's
    # prefill of each prompt alone; at micro-batch 3 they differ only by rounding
    p = s["metrics"]["prompt"]
    assert p["tokens"] == sum(x[1] - 1 for x in files["sequences"]) and p["max_abs"] < 1e-4


def test_top_k_renormalised_logprobs_are_detected(files):
    s = _rollout(files["processed"], files["model"], micro_batch=(1,), modes=("prefill",), fixes=("none",))
    pr = s["processed"]
    assert pr["detected"] is True and pr["kind"] == "top-k" and pr["fit_k"] == 4
    assert s["metrics"]["mean_diff"] > 0.01  # renormalising raises every logprob
    assert any("processed" in n for n in s["notes"])
    # what to do first: raw logprobs (tests/test_rollout_what_to_do.py: a raw file is not told so)
    assert s["what_to_do"]["case"] == "none"
    assert "First ask the engine for raw logprobs" in s["what_to_do"]["line"]


@pytest.mark.parametrize("body,where", [
    ('{"input_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-0.5, -0.1]}\n'
     '{"input_ids": [1, 2, 3], "prompt_len": 2, "logprobs": [-0.5, -0.1]}\n', "line 2: field 'logprobs'"),
    ('{"input_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-0.5, -0.1]}\n{"input_ids": [1, \n',
     "line 2: not JSON"),
    ('{"choices": [{"logprobs": {"content": []}}]}', "prompt_token_ids"),
    # a missing field says what it holds (it named the field alone)
    ('{"input_ids": [1, 2, 3], "logprobs": [-0.5, -0.1]}\n',
     "line 1: missing field 'prompt_len' (the number of prompt tokens at the start of input_ids)"),
    ('{"meta_info": {"input_token_logprobs": [[null, 1, "a"]], "output_token_logprobs": [[0.5, 2, "b"]]}}',
     "meta_info.output_token_logprobs[0][0]"),
])
def test_malformed_file_is_one_line_exit_2(tmp_path, body, where):
    f = tmp_path / "bad.jsonl"
    f.write_text(body)
    r = run_cli("rollout", str(f), "--model", "tiny-llama", "--device", "cpu")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and str(f) in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_negative_top_is_refused(tmp_path):
    # `--top -1` listed no worst tokens without a word (it was clamped to 0)
    f = tmp_path / "r.jsonl"
    f.write_text('{"input_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-0.5, -0.1]}\n')
    r = run_cli("rollout", str(f), "--model", "tiny-llama", "--device", "cpu", "--top", "-1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["error: --top -1: must be >= 0 (the number of worst tokens to list; "
                                             "0 lists none)"], r.stderr


def test_tp2_world_and_builtin_decode(files):
    """TP=2 runs in a real gloo world through compare's launcher; tiny-llama (the same vocab,
    other weights: the engine's numbers are not its own) decodes through its own KV cache."""
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    s = run_rollout(RolloutConfig(file=files["jsonl"], model="tiny-llama", tp=(1, 2), micro_batch=(1,),
                                  modes=("prefill", "decode"), fixes=("none", "all"), timeout=120))
    c = s["configurations"]
    for t in (1, 2):
        for m in ("prefill", "decode"):
            for f in ("none", "all"):
                assert c[f"tp{t}-mb1-{m}-{f}"]["status"] == "ok", (t, m, f, c[f"tp{t}-mb1-{m}-{f}"])
    # the invariant kernels make TP=2 the TP=1 bits, and decode (prompt in one call, then one
    # token per call through the cache) prefill's bits; stock TP=2 reduces in another order
    assert c["tp2-mb1-prefill-all"]["same_bits_as"] == "tp1-mb1-prefill-all"
    assert c["tp1-mb1-decode-all"]["same_bits_as"] == "tp1-mb1-prefill-all"
    assert c["tp2-mb1-decode-all"]["same_bits_as"] == "tp1-mb1-prefill-all"
    assert c["tp2-mb1-prefill-none"]["same_bits_as"] is None
    # negative control: stock decode is other GEMM and attention shapes than stock prefill
    assert c["tp1-mb1-decode-none"]["same_bits_as"] is None
    assert c["tp2-mb1-prefill-none"]["metrics"]["tokens"] == s["generated_tokens"]


def test_temperature_scaled_logprobs_are_detected(files, tmp_path):
    """An engine that reports log_softmax(logits / T) for the tokens it sampled."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32).eval()
    lines = []
    with torch.no_grad():
        for ids, p, _, _ in files["sequences"]:
            rows = torch.log_softmax(model(torch.tensor([ids])).logits[0] / 0.7, -1)
            lines.append({"input_ids": ids, "prompt_len": p,
                          "logprobs": [float(rows[t - 1, ids[t]]) for t in range(p, len(ids))]})
    f = tmp_path / "temp.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    pr = _rollout(str(f), files["model"], micro_batch=(1,), modes=("prefill",), fixes=("none",))["processed"]
    assert pr["detected"] is True and pr["kind"] == "temperature" and pr["temperature_fit"] == 0.7


def test_reported_top_k_summing_to_one_is_detected(files, tmp_path):
    """The processed rollout again, now with the engine's reported top-4 per token (renormalised
    over those 4, as an engine reporting processed logprobs gives them): they sum to 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32).eval()
    lines = []
    with open(files["processed"]) as f:
        for line in f:
            x = json.loads(line)
            ids, p = x["input_ids"], x["prompt_len"]
            with torch.no_grad():
                z = model(torch.tensor([ids])).logits[0]
            top = []
            for t in range(p, len(ids)):
                v, i = z[t - 1].topk(4)
                top.append([[int(a), float(b)] for a, b in zip(i, torch.log_softmax(v, -1))])
            lines.append({**x, "top_logprobs": top})
    f = tmp_path / "top.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    pr = _rollout(str(f), files["model"], micro_batch=(1,), modes=("prefill",), fixes=("none",))["processed"]
    assert pr["detected"] is True and pr["kind"] == "renormalised"
    assert pr["reported_top_mass_median"] > 0.999 > 0.99 > pr["trainer_mass_on_them_median"]


def test_a_micro_batch_above_the_files_sequences_is_named(files):
    # a generate() batch of 4 against the default --micro-batch 8,1 read `tp1-mb8-decode-none
    # *reproduces` with no word that mb8 ran 4 sequences a call: an engine batch of 8 to the reader.
    # Now a note says it, and the bits are micro-batch 3's (the file's 3 sequences in one call)
    s = _rollout(files["jsonl"], files["model"], micro_batch=(8, 3, 1), modes=("prefill",), fixes=("none",))
    said = [n for n in s["notes"] if n.startswith("--micro-batch")]
    assert said == ["--micro-batch 8 is more than the file's 3 sequences: its configurations (mb8) run all 3 "
                    "in one call, the calls of micro-batch 3 (the default is 8,1): an engine those reproduce "
                    "ran a batch of 3"], s["notes"]
    # (control: 3 and 1, which the file fills, are not named)
    assert s["configurations"]["tp1-mb3-prefill-none"]["same_bits_as"] == "tp1-mb8-prefill-none"
