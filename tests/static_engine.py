"""The user's engine of the static-cache rollout tests (tests/test_rollout_static_cache.py,
tests/test_rollout_static_checkpoint.py): one sampled generate(cache_implementation="static") over
tests/rl_team.py's LENS left-padded, as tpdiag's JSONL rows with the raw logprobs
(output_logits)."""
import json

import torch


def static_rows(model, stop, seed=1, **generate):
    """Rows of one generate(cache_implementation="static", **generate) call, the prompts drawn with
    seed 1 and the sampling with `seed`; each sequence cut after its first token in `stop`."""
    from tests.rl_team import left_padded

    ids, mask = left_padded(model.config.vocab_size)
    P = ids.shape[1]
    torch.manual_seed(seed)
    res = model.generate(ids, attention_mask=mask, do_sample=True, cache_implementation="static",
                         output_logits=True, return_dict_in_generate=True, **generate)
    lp = torch.stack(res.logits, 1).float().log_softmax(-1)
    rows = []
    for b in range(len(ids)):
        gen = res.sequences[b, P:].tolist()
        end = next((j for j, t in enumerate(gen) if t in stop), None)
        gen = gen if end is None else gen[:end + 1]
        rows.append({"input_ids": ids[b][mask[b].bool()].tolist() + gen, "prompt_len": int(mask[b].sum()),
                     "logprobs": [lp[b, j, t].item() for j, t in enumerate(gen)]})
    return rows


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(path)
