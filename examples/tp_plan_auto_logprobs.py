"""A trainer's logprobs at TP > 1 as transformers computes them - `from_pretrained(DIR,
tp_plan="auto")` under torchrun - to hold against `tpdiag rollout --tp 1,2`'s TP=2 prefill:

    torchrun --nproc-per-node 2 examples/tp_plan_auto_logprobs.py DIR rollout.jsonl out.json

Each rank runs one CPU thread (as tpdiag's worlds do) on gloo, forwards the file's sequences as one
right-padded batch (no mask: causal, as tpdiag's prefill) and rank 0 writes per sequence the float32
log_softmax of the gathered logits at each next token ({"lp": [[...], ...]}, position t - 1
predicting input_ids[t]). transformers' TP on a CPU needs `accelerate` installed.
"""
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def main(path: str, rows_file: str, out: str, dtype: str = "bfloat16") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), tp_plan="auto").eval()
    rows = [json.loads(line) for line in open(rows_file) if line.strip()]
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
    with torch.no_grad():
        logits = model(ids).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    lsm = logits.float().log_softmax(-1)
    lp = [lsm[i, :len(r["input_ids"]) - 1].gather(-1, torch.tensor(r["input_ids"][1:])[:, None])[:, 0].tolist()
          for i, r in enumerate(rows)]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"lp": lp}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
