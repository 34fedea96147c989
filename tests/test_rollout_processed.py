"""The engine's logprobs computed another common way, from generate()'s own outputs: tpdiag says what
they are instead of 'no sign of processing'. On 85fe6da a temperature outside 0.5..2 (T=3) and a
temperature followed by top-p (generate()'s output_scores at T=0.7, top_p=0.9) both read 'no sign of
processing', and a rollout with a few tokens replaced read 'processed'. Negative controls: a bf16
engine against a float32 trainer (precision noise) and the engine's raw logits fit no processing."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.test_rollout_generate_zoo import _write  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _write("llama", tmp_path_factory.mktemp("proc") / "llama", rope_theta=500000.0)


def _engine(path, dtype="float32", scores=False, divide=1.0, **sample):
    """One generate() call over 4 left-padded prompts, 8 tokens each; each chosen token's logprob
    from log_softmax(output_logits / divide), or from output_scores (what the sampler drew from)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    m.generation_config.eos_token_id = None  # no EOS: no min-length processor in the scores
    g = torch.Generator().manual_seed(1)
    lens, P = (5, 8, 6, 7), 8
    ids = torch.zeros(4, P, dtype=torch.long)
    mask = torch.zeros(4, P, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, P - n:] = torch.randint(3, 128, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(1)
    res = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                     output_logits=True, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                     **{"top_k": 0, "top_p": 1.0, "temperature": 1.0, **sample})
    steps = res.scores if scores else res.logits
    return [{"input_ids": res.sequences[r, P - n:].tolist(), "prompt_len": n,
             "logprobs": [float(torch.log_softmax(s[r].float() / divide, -1)[res.sequences[r, P + j]])
                          for j, s in enumerate(steps)]} for r, n in enumerate(lens)]


def _processed(tmp_path, rows, model):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return run_rollout(RolloutConfig(file=str(f), model="hf:" + model, micro_batch=(4,), modes=("decode",),
                                     fixes=("none",)))["processed"]


def test_temperature_outside_half_to_two_is_named(tmp_path, model):
    pr = _processed(tmp_path, _engine(model, temperature=3.0, divide=3.0), model)
    assert pr["detected"] is True and pr["kind"] == "temperature" and pr["temperature_fit"] == 3.0


def test_temperature_then_top_p_from_generate_scores_is_named(tmp_path, model):
    pr = _processed(tmp_path, _engine(model, scores=True, temperature=0.7, top_p=0.9), model)
    assert pr["detected"] is True and pr["kind"] == "temperature+filter" and pr["temperature_fit"] == 0.7
    assert "temperature 0.7" in pr["explanation"]


def test_temperature_then_top_k_then_top_p_is_named(tmp_path, model):
    # generate()'s top-p measures mass after top-k renormalised the K kept, so the kept prefixes
    # reach p of the top-K mass, not of the whole: no one p of the whole fit and the verdict read
    # "log_softmax(logits / 0.55) ... temperature-scaled" (a plain T nearer than raw, named first)
    pr = _processed(tmp_path, _engine(model, scores=True, temperature=0.7, top_k=20, top_p=0.9), model)
    assert pr["detected"] is True and pr["kind"] == "temperature+filter" and pr["temperature_fit"] == 0.7, pr
    assert "temperature 0.7" in pr["explanation"]


def test_a_repetition_penalty_is_named_among_the_causes(tmp_path, model):
    # generate()'s repetition_penalty divides the seen tokens' logits before temperature and the
    # filters: nothing here models it, and the 'systematic' line named only filters and another model
    pr = _processed(tmp_path, _engine(model, scores=True, temperature=0.7, top_k=20, top_p=0.9,
                                      repetition_penalty=1.3), model)
    assert pr["detected"] is True and pr["kind"] == "systematic", pr
    assert "repetition_penalty" in pr["explanation"]


def test_noise_and_replaced_tokens_are_not_called_processing(tmp_path, model):
    # raw logits at T=0.7: the engine's numbers are the trainer's
    pr = _processed(tmp_path, _engine(model, temperature=0.7), model)
    assert pr["detected"] is False
    # a bf16 engine against the float32 trainer: differences both ways, no temperature or filter
    pr = _processed(tmp_path, _engine(model, "bfloat16"), model)
    assert pr["detected"] is False and pr["kind"] is None, pr
    # the last token of every sequence replaced (the logprob is another token's): not a filter
    rows = _engine(model)
    for x in rows:
        x["input_ids"][-1] = (x["input_ids"][-1] + 7) % 128
    pr = _processed(tmp_path, rows, model)
    assert pr["detected"] is False, pr


def test_top_k_with_ties_at_the_kth_is_top_k():
    # transformers' top-k keeps every token tied with the K-th (`scores < topk(...)[..., -1]` is what
    # it removes): on a bf16 model the kept count varies with the ties and the fit read "top-p ~ 0.39"
    # for generate()'s default top_k=50. Rows whose 4th probability is tied with others, kept
    # whole: one K (4) fits every row once ties count.
    from tpdiag.rollout.processed import Collector, judge
    from tpdiag.rollout.read import Sequence

    rows = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, 0.0],    # the 4th tied with the 3rd and 5th
                         [5.0, 4.0, 3.5, 3.0, 3.0, 3.0, 1.0, 0.0],    # the 4th tied with the 5th and 6th
                         [5.0, 4.0, 3.5, 3.0, 2.0, 1.0, 0.0, -1.0],   # no tie: 4 kept
                         [6.0, 4.0, 3.0, 2.5, 2.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    seqs, picked = [], [0, 2, 1, 3]
    for r, t in zip(rows, picked):
        kept = r >= r.topk(4).values[-1]                              # TopKLogitsWarper with ties
        lp = torch.log_softmax(r.masked_fill(~kept, float("-inf")), -1)[t]
        seqs.append(Sequence([7, t], 1, [float(lp)], where=f"line {len(seqs) + 1}"))
    col = Collector(seqs)
    for i, r in enumerate(rows):
        col(i, r[None].float())
    v = judge(col, vocab=8)
    assert v["detected"] and v["kind"] == "top-k" and v["fit_k"] == 4 and v["fit_k_max"] == 4, v
    assert "top-k=4, ties kept" in v["explanation"] and "generate(): output_logits" in v["explanation"]
    # control: kept sets no one K explains (2, 3 and 5 tokens, no ties) are still top-p
    seqs = []
    for r, n in zip(rows[2:3].repeat(3, 1), (2, 3, 5)):
        kept = torch.zeros(8, dtype=torch.bool)
        kept[r.sort(descending=True).indices[:n]] = True
        seqs.append(Sequence([7, 0], 1, [float(torch.log_softmax(r.masked_fill(~kept, float("-inf")), -1)[0])],
                             where="line 1"))
    col = Collector(seqs)
    for i in range(3):
        col(i, rows[2:3].float())
    assert judge(col, vocab=8)["kind"] == "top-p"


def test_top_k_ties_the_trainers_rounding_broke_are_top_k():
    # generate()'s default top_k=50 on a bf16 Qwen3 (vocab 256), its output_scores against the
    # trainer's prefill (the first configuration, as --mode prefill,decode runs): read "top-p ~
    # 0.236" - the engine's decode logits tie at the 50th where the prefill's, one bf16 rounding
    # away, do not (with --mode decode first: "top-k=50"). Engine rows on bf16's grid whose K-th
    # (K=4) ties; the trainer's the same with each tie broken by one bf16 ulp, as a prefill's GEMMs
    # break it against a decode step's.
    from tpdiag.rollout.processed import Collector, judge
    from tpdiag.rollout.read import Sequence

    engine = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, 0.0],    # the 4th tied with the 3rd and 5th
                           [5.0, 4.0, 3.5, 3.0, 3.0, 3.0, 1.0, 0.0],    # the 4th tied with the 5th and 6th
                           [5.0, 4.0, 3.5, 3.0, 2.0, 1.0, 0.0, -1.0]],  # no tie: 4 kept
                          dtype=torch.float64)
    u = 2.0 ** -6                                                       # bf16's ulp at 3
    trainer = engine + torch.tensor([[0, 0, u, 0, -u, 0, 0, 0],
                                     [0, 0, 0, u, 0, -u, 0, 0],
                                     [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    assert torch.equal(trainer.bfloat16().double(), trainer)

    def verdict(engine, trainer, keep):
        seqs = []
        for r, n in zip(engine, keep):
            kept = r >= r.sort(descending=True).values[n - 1]          # TopKLogitsWarper keeps ties
            t = int(r.argmax())
            lp = torch.log_softmax(r.masked_fill(~kept, float("-inf")), -1)[t]
            seqs.append(Sequence([7, t], 1, [float(lp)], where=f"line {len(seqs) + 1}"))
        col = Collector(seqs)
        for i, r in enumerate(trainer):
            col(i, r[None].float())
        return judge(col, vocab=8)

    v = verdict(engine, trainer, (4, 4, 4))
    assert v["detected"] and v["kind"] == "top-k" and v["fit_k"] == 4 and v["fit_k_max"] == 4, v
    assert "top-k=4, ties kept" in v["explanation"], v["explanation"]
    # the engine's own rows: the exact ties alone read it (as before)
    assert verdict(engine, engine, (4, 4, 4))["fit_k"] == 4
    # control: kept sets of 5 and 4 whose 4th and 5th logits are 16 ulps apart - not a tie any
    # rounding breaks - stay top-p, on either side's rows
    apart = engine.clone()
    apart[0, 2:5] = torch.tensor([3.25, 3.0, 2.75])
    v = verdict(apart, apart, (5, 4, 4))
    assert v["detected"] and v["kind"] == "top-p", v


def _seqs_from(rows, shifts):
    """One generated token per row (its top token), the engine's logprob the trainer's plus shift."""
    from tpdiag.rollout.read import Sequence

    seqs = []
    for r, sh in zip(rows, shifts):
        t = int(r.argmax())
        seqs.append(Sequence([7, t], 1, [float(torch.log_softmax(r, -1)[t].float()) + sh],
                             where=f"line {len(seqs) + 1}"))
    return seqs


def _judge(rows, shifts):
    from tpdiag.rollout.processed import Collector, judge

    col = Collector(_seqs_from(rows, shifts))
    for i, r in enumerate(rows):
        col(i, r[None])
    return judge(col, vocab=rows.shape[1])


def test_one_raised_token_beside_lowered_ones_is_not_a_filter():
    # a raw bf16 deepseek_v3 rollout against its prefill: 75 of 79 tokens exact, one raised 0.0038,
    # one lowered 0.0076 - read "1 of 1 raised tokens are exactly ... top-k=251" of a vocabulary of
    # 256 (any small raise is some tail prefix's mass), and "the engine's logprobs look processed"
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(40, 256, generator=g, dtype=torch.float64) * 0.3).float().double()
    tail = [float(-torch.log_softmax(r, -1).exp().sort(descending=True).values[:251].sum().log()) for r in rows]
    shifts = [0.0] * 40
    shifts[0] = tail[0]            # raised exactly by the mass of its top 251: fits top-k=251
    shifts[1] = -tail[0] * 2       # lowered further: noise of that size goes both ways
    v = _judge(rows, shifts)
    assert v["detected"] is False and v["kind"] is None, v
    # control: two tokens raised by their top-251 mass, none lowered: a top-k is still named
    shifts[1] = tail[1]
    v = _judge(rows, shifts)
    assert v["detected"] is True and v["kind"] == "top-k" and v["fit_k"] == 251, v


def test_a_reproduced_raw_engine_is_never_called_processed(tmp_path, model, monkeypatch):
    # whatever the fit on the first configuration's rows says, a configuration whose raw
    # log-softmax is every engine number bit for bit shows the engine's logprobs are raw
    from tpdiag.rollout import processed
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in _engine(model)))
    monkeypatch.setattr(processed, "judge", lambda col, vocab: {
        "detected": True, "kind": "top-k", "fit_kind": "top-k", "fit_k": 251, "explanation": "a fit"})
    s = run_rollout(RolloutConfig(file=str(f), model="hf:" + model, micro_batch=(4,), modes=("prefill", "decode"),
                                  fixes=("none",)))
    assert s["closest"]["reproduced"] is True and s["closest"]["configurations"] == ["tp1-mb4-decode-none"]
    pr = s["processed"]
    assert pr["detected"] is False and pr["kind"] is None and "fit_k" not in pr, pr
    assert pr["explanation"].startswith("tp1-mb4-decode-none gives every engine logprob bit for bit"), pr
    assert not any("look processed" in n for n in s["notes"]), s["notes"]


def test_temperature_top_k_top_p_with_ties_at_the_kth_is_named():
    # generate()'s temperature, then top-k (which keeps every token tied with the K-th), then top-p on
    # the mass of those kept. A Gemma2 saved in bf16 sampled at T=0.9, top_k=40, top_p=0.95 (its bf16
    # logits tie often: one row kept 41) read "systematic ... as when a penalty moved the logits ... or
    # min_p": no one K fitted every row until the ties counted. Rows on a coarse grid, half with the
    # K-th tied with the next; the engine's numbers are transformers' own warpers' on them.
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    from tpdiag.rollout.processed import Collector, judge
    from tpdiag.rollout.read import Sequence

    g = torch.Generator().manual_seed(0)
    V, K, p, T = 16, 4, 0.9, 0.9
    rows, seqs, kept = [], [], []
    for r in range(8):
        x = ((torch.randn(V, generator=g) * 4).round() / 4).sort(descending=True).values
        x[4] = x[3] if r % 2 == 0 else x[3] - 0.5
        rows.append(x[torch.randperm(V, generator=g)])
    for i, x in enumerate(rows):
        s = x[None].float()
        for w in (TemperatureLogitsWarper(T), TopKLogitsWarper(K), TopPLogitsWarper(p)):
            s = w(None, s)
        kept.append(int(torch.isfinite(s).sum()))
        t = int(x.argmax())
        seqs.append(Sequence([7, t], 1, [float(s.log_softmax(-1)[0, t])], where=f"line {i + 1}"))
    assert max(kept) > K  # ties past the K-th were kept
    col = Collector(seqs)
    for i, x in enumerate(rows):
        col(i, x[None].float())
    v = judge(col, vocab=V)
    assert v["detected"] and v["kind"] == "temperature+filter" and v["temperature_fit"] == T, v
    assert "temperature 0.9" in v["explanation"]
    # control: the same rows read without the ties a top-K keeps fit no one filter
    for st in col.stats.values():
        st.pop("top_k_kept")
    assert judge(col, vocab=V)["kind"] != "temperature+filter"
