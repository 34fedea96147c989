"""Are the file's logprobs bfloat16 (or float16) numbers? (docs/rl.md, `low_precision`)

A trainer that takes its log-softmax in bf16 (TRL's and verl's row loop over bf16 logits, a bf16
model's `logits.log_softmax(-1)`) or stores its logprobs in a bf16 tensor writes numbers with 8
significant bits. A float32 logprob is a bf16 number by chance once in 65536, so a file whose every
logprob is one says what wrote it. Such a file is the trainer's logprobs rounded, not another
function - where every token is within that rounding of the trainer's own logits (float64
log-softmax): the cast of each logit to the 8-bit dtype moves the log-softmax by at most
2u x max|logit| (so do a bf16 model's own logits, rounded from other float32 sums than the trainer's)
and the rounding of the result by u x |logprob| (u = 2^-8 for bf16, 2^-11 for fp16).
Before, such a file read `not reproduced ... not shown to be rounding` and advised attention and
static-cache settings; `--logprob model-dtype` (a bf16 model's own recipe) was never named.
"""
from __future__ import annotations

import math

# (dtype name, unit roundoff), narrowest first: a bf16 number is an fp16 number only within fp16's range
DTYPES = (("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11))
# fewer tokens than this say nothing (one token in 65536 is a bf16 number by chance)
MIN_TOKENS = 4


def _is(x: float, dtype: str) -> bool:
    import torch

    t = torch.tensor(x, dtype=torch.float64)
    return bool(t.to(getattr(torch, dtype)).double() == t)


def judge(seqs, stats: dict, recipe=None) -> dict | None:
    """{dtype, tokens, within, rounding (bool), worst (|diff| / bound at the worst token), line} or None."""
    if recipe is not None and recipe.name == "model-dtype":  # the configurations compute bf16 numbers themselves
        return None
    vals = [(s, j, lp) for s in seqs for j, lp in enumerate(s.logprobs) if math.isfinite(lp)]
    # exact zeros (a token of probability 1 in the dtype) are every dtype's numbers: they say nothing
    if sum(1 for *_, lp in vals if lp != 0.0) < MIN_TOKENS:
        return None
    for dtype, u in DTYPES:
        if all(_is(lp, dtype) for *_, lp in vals):
            break
    else:
        return None
    ratios = []
    for i, s in enumerate(seqs):
        for j, lp in enumerate(s.logprobs):
            st = stats.get((i, s.prompt_len + j))
            if st is None or not math.isfinite(lp) or "own" not in st:
                continue
            bound = u * (abs(st["own"]) + 2.0 * st["zmax"])
            ratios.append(abs(lp - st["own"]) / bound if bound > 0 else math.inf)
    within = sum(r <= 1.0 for r in ratios)
    rounding = bool(ratios) and within == len(ratios)
    line = (f"{dtype} logprobs: all {len(vals)} of the file's logprobs are {dtype} numbers (a float32 logprob is "
            f"one by chance once in {2 ** (23 - (7 if dtype == 'bfloat16' else 10))}): whatever wrote the file took "
            f"the log-softmax in {dtype} (a {dtype} model's logits.log_softmax(-1), TRL's and verl's row loop on "
            f"{dtype} logits) or stored the logprobs in {dtype}. ")
    if rounding:
        line += (f"Every token is within {dtype}'s rounding of the trainer's logits (u(|logprob| + 2 max|logit|), "
                 f"u = 2^{int(math.log2(u))}; worst {max(ratios):.2g} of it): the gap is that rounding, not a bug. "
                 f"--logprob model-dtype computes a {dtype} model's own {dtype} log-softmax; logprobs taken in "
                 "float32 (logits.float().log_softmax(-1)) remove the gap")
    else:
        line += (f"{len(ratios) - within} of {len(ratios)} tokens are beyond {dtype}'s rounding of the trainer's "
                 f"logits (u(|logprob| + 2 max|logit|), u = 2^{int(math.log2(u))}; worst {max(ratios, default=0):.3g}x "
                 f"it): more than the {dtype} logprob differs")
    return {"dtype": dtype, "tokens": len(ratios), "within": within, "rounding": rounding,
            "worst": max(ratios, default=None), "line": line}
