"""transformers' generate() on a GPU as the rollout engine, reproduced by `tpdiag rollout --device
cuda` (skipped without CUDA; run on the lent GPU machines, docs/scale.md).

- The default generate() (DynamicCache, eager): tpdiag's decode is its logprobs bit for bit.
- generate(cache_implementation="static", disable_compile=True): `--padding static` is its bits.
- generate(cache_implementation="static") without disable_compile (TRL passes it; a plain call does
  not): on CUDA transformers runs the decode steps through torch.compile. `--padding compiled` is
  its bits; the eager static decode is not (the negative control).
"""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.rl_team import LENS, left_padded, save_bf16  # noqa: E402


def _engine(path, **gen):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids, mask = left_padded(model.config.vocab_size)
    P = ids.shape[1]
    torch.manual_seed(1)
    res = model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=True, max_new_tokens=10,
                         eos_token_id=2, output_logits=True, return_dict_in_generate=True, **gen)
    lp = torch.stack(res.logits, 1).float().log_softmax(-1).cpu()
    seqs = res.sequences.cpu()
    rows = []
    for b in range(len(ids)):
        prompt = ids[b][mask[b].bool()].tolist()
        new = seqs[b, P:].tolist()
        if 2 in new:
            new = new[:new.index(2) + 1]
        rows.append({"input_ids": prompt + new, "prompt_len": len(prompt),
                     "logprobs": [lp[b, j, t].item() for j, t in enumerate(new)]})
    return rows


def _exact(rows, got):
    return sum(torch.equal(got[i][x["prompt_len"] - 1:], torch.tensor(x["logprobs"], dtype=torch.float32))
               for i, x in enumerate(rows))


def _run(tmp_path, path, rows, padding):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    f = tmp_path / f"e-{'-'.join(padding)}.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    got = {}
    s = run_rollout(RolloutConfig(file=str(f), model="hf:" + path, dtype="bfloat16", device="cuda",
                                  micro_batch=(len(rows),), modes=("decode",), fixes=("none",), padding=padding),
                    on_logprobs=got.update)
    return s, got


def test_generate_on_cuda_is_reproduced(tmp_path):
    path = save_bf16("qwen2", tmp_path / "q")
    n = len(LENS)
    rows = _engine(path)
    _, got = _run(tmp_path, path, rows, ("auto",))
    assert _exact(rows, got[f"tp1-mb{n}-decode-none"]) == n

    rows = _engine(path, cache_implementation="static", disable_compile=True)
    s, got = _run(tmp_path, path, rows, ("auto", "static"))
    assert _exact(rows, got[f"tp1-mb{n}-decode-none-padstatic"]) == n
    assert any("decodes eagerly" in x for x in s["notes"]), s["notes"]

    # generate(cache_implementation="static") without disable_compile: its decode steps compiled on
    # CUDA. `--padding compiled` runs them through the model's own compiled call: its bits; the eager
    # static decode is not (0 of 4 on an H200 at 170f498 - the negative control)
    rows = _engine(path, cache_implementation="static")
    s, got = _run(tmp_path, path, rows, ("static", "compiled"))
    eager = _exact(rows, got[f"tp1-mb{n}-decode-none-padstatic"])
    comp = _exact(rows, got[f"tp1-mb{n}-decode-none-padcompiled"])
    print(f"compiled static engine: --padding compiled matched {comp}, static {eager} of {n} sequences")
    assert comp == n and eager < n
    assert s["closest"]["configurations"] == [f"tp1-mb{n}-decode-none-padcompiled"], s["closest"]
