"""generate() as the engine for architectures beyond Llama/Qwen3 - tiny random checkpoints saved with
save_pretrained, loaded with from_pretrained, one generate() call over a left-padded batch, sampled,
the chosen tokens' logprobs from output_logits - reproduced bit for bit by `tpdiag rollout` at the
engine's own settings (TP=1, micro-batch = the batch, decode, no fix, default flags):

- Phi-3 with longrope: its own prepare_inputs_for_generation drops the KV cache at the step that
  crosses original_max_position_embeddings (the rope factors switch) and recomputes the prefix;
  tpdiag's decode read 4/32 before it asked the model for its inputs as generate() does.
- a MoE (qwen3_moe) batch whose sequences end early at EOS: generate() feeds an ended sequence its
  EOS at the next step and the pad token after it; the router batches them with the other rows'
  tokens, so the experts' GEMM shapes - and other sequences' bits - depend on it (40/51 before).
"""
import collections
import json

import pytest
import torch

pytest.importorskip("transformers")

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _write(kind, out, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **{**BASE, **over})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # sharper next-token distributions than the default init's
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    model.save_pretrained(out)
    return str(out)


def _generate(path, lens, new, eos=None, seed=1):
    """The user's engine: [{"input_ids", "prompt_len", "logprobs"}] of one generate() call, cut at
    each sequence's EOS (kept: it is a generated token with a logprob)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    P = max(lens)
    ids = torch.zeros(len(lens), P, dtype=torch.long)
    mask = torch.zeros(len(lens), P, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, P - n:] = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        mask[r, P - n:] = 1
    torch.manual_seed(seed)
    stop = {"min_new_tokens": new} if eos is None else {"eos_token_id": eos}
    res = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=True, top_k=0, top_p=1.0,
                         temperature=1.0, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         **stop)
    out = []
    for r, n in enumerate(lens):
        seq = res.sequences[r].tolist()
        if eos is not None and eos in seq[P:]:
            seq = seq[:P + seq[P:].index(eos) + 1]
        lps = [float(torch.log_softmax(s[r].float(), -1)[seq[P + j]]) for j, s in enumerate(res.logits)
               if P + j < len(seq)]
        out.append({"input_ids": seq[P - n:], "prompt_len": n, "logprobs": lps})
    return out


def _rollout(tmp_path, rows, model, mb):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / "rollout.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    s = run_rollout(RolloutConfig(file=str(f), model="hf:" + model, micro_batch=(mb,), modes=("decode",),
                                  fixes=("none",)))
    return s, s["configurations"][f"tp1-mb{mb}-decode-none"]["metrics"]


def test_phi3_longrope_generate_is_reproduced_through_its_own_input_preparation(tmp_path, monkeypatch):
    model = _write("phi3", tmp_path / "phi3", max_position_embeddings=64, original_max_position_embeddings=8,
                   rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8))
    rows = _generate(model, (5, 8, 6, 7), 8)  # 8 + 8 tokens: the batch crosses position 8 while decoding
    s, m = _rollout(tmp_path, rows, model, 4)
    assert m["exact_tokens"] == m["tokens"] == 32 and m["token_mult_prob_error"] == 1.0
    assert s["closest"]["reproduced"] is True
    # negative control: the decode loop that drives the cache without the model's own input
    # preparation (what tpdiag ran before) keeps the short-factor keys: not the engine
    from tpdiag.runner import decode

    monkeypatch.setattr(decode, "_generate_inputs", lambda model: False)
    s, m = _rollout(tmp_path, rows, model, 4)
    assert m["exact_tokens"] < m["tokens"] and s["closest"]["reproduced"] is False


def test_moe_batch_with_sequences_ending_at_eos_is_reproduced(tmp_path, monkeypatch):
    model = _write("qwen3_moe", tmp_path / "moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   decoder_sparse_step=1, norm_topk_prob=True)
    lens = (5, 8, 6, 7, 4, 3)
    first = _generate(model, lens, 12)
    # an EOS the engine samples: the most frequent early token, so sequences end at different steps
    eos = collections.Counter(t for x in first for t in x["input_ids"][x["prompt_len"]:x["prompt_len"] + 9]
                              ).most_common(1)[0][0]
    rows = _generate(model, lens, 12, eos=eos)
    n = [len(x["logprobs"]) for x in rows]
    assert min(n) < max(n) == 12, n  # some sequences did end early
    s, m = _rollout(tmp_path, rows, model, len(lens))
    assert m["exact_tokens"] == m["tokens"] == sum(n) and s["closest"]["reproduced"] is True
    # negative control: the ended sequences fed pad id 0 from their last token on (before): their
    # EOS is not routed with the others' tokens at the step after it
    from tpdiag.rollout import compute

    real = compute.decode_inputs

    def old(group, plen, steps, pad):
        ids, mask = real(group, plen, steps, 0)
        for r, x in enumerate(group):
            end = plen + x.n_generated - 1
            ids[r, end:] = 0
        return ids, mask

    monkeypatch.setattr(compute, "decode_inputs", old)
    s, m = _rollout(tmp_path, rows, model, len(lens))
    assert m["exact_tokens"] < m["tokens"] and s["closest"]["reproduced"] is False


def test_model_without_tp_plan_runs_at_tp1_and_is_refused_at_tp2(tmp_path):
    """stablelm has no TP plan in transformers: TP=1 needs none (it was refused there, 'it cannot
    run at TP > 1'), and --tp 1,2 is refused in one line before any model is built."""
    from tpdiag.errors import BadInput
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    model = _write("stablelm", tmp_path / "stablelm")
    rows = _generate(model, (5, 8, 6, 7), 6)
    s, m = _rollout(tmp_path, rows, model, 4)
    assert m["exact_tokens"] == m["tokens"] == 24 and s["closest"]["reproduced"] is True
    with pytest.raises(BadInput, match="stablelm has no tensor-parallel plan in transformers"):
        run_rollout(RolloutConfig(file=str(tmp_path / "rollout.jsonl"), model="hf:" + model, tp=(1, 2),
                                  micro_batch=(4,), modes=("decode",), fixes=("none",)))
