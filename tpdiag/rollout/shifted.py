"""Is each number in the file the logprob of another token than the one it stands beside?

An off-by-one between logits and labels - labels shifted one too far, logits not shifted at all,
the logprobs list written one token late - is the commonest RL pipeline bug between sampler and
trainer, and it is no rounding: every token moves by nats. Rounding cannot make the engine's
numbers fit a neighbouring token's logprob, so a neighbour that fits where the aligned token does
not names the misalignment. The trainer's logits rows (the first TP=1 configuration's, as the
processed check reads them) give each candidate; rows[t - 1] predicts input_ids[t].
"""
from __future__ import annotations

import math

# (row offset, token offset) from the aligned (rows[t - 1], input_ids[t]), and what it means
CANDIDATES = {
    (0, 1): "the next token's logprob, read from the logits row that predicts this token (the labels shifted "
            "one position too far)",
    (0, -1): "the previous token's logprob, read from the logits row that predicts this token (the labels not "
             "shifted, or the logprobs written one token late)",
    (1, 0): "this token's logprob read from the next logits row, not the one that predicts it (the logits "
            "and labels not shifted against each other)",
    (-1, 0): "this token's logprob read from the logits row before the one that predicts it (the labels "
             "shifted twice)",
}
# the aligned numbers must be this far from the engine's (median |diff|, nats) to need explaining
# (a bf16 generate() against its bf16 prefill: mean 0.013, max 0.054 in tests/test_rl_policy_trial.py;
# where rounding is larger the fit below, a tenth of it, is the stronger evidence)
BEYOND = 0.05
# a candidate fits where its median |diff| is this fraction of the aligned one's, or less, ...
RATIO = 0.1
# ... and at least this many of the tokens it can be read at
MIN_TOKENS = 4


class Pairs:
    """on_logits hook: per candidate, (engine, candidate logprob) at every generated token where the
    candidate's row and token exist; and (engine, aligned logprob) at the same tokens."""

    def __init__(self, seqs):
        self.seqs = seqs
        self.pairs: dict[tuple[int, int], list[tuple[float, float, float]]] = {k: [] for k in CANDIDATES}

    def __call__(self, i: int, rows) -> None:
        import torch

        s = self.seqs[i]
        lsm = torch.log_softmax(rows.double(), -1)
        ids = s.input_ids
        n_rows = lsm.shape[0]  # len(ids) - 1
        for (dr, dt), got in self.pairs.items():
            for j, eng in enumerate(s.logprobs):
                t = s.prompt_len + j
                r, tok = t - 1 + dr, t + dt
                if 0 <= r < n_rows and 0 <= tok < len(ids) and math.isfinite(eng):
                    c, a = float(lsm[r, ids[tok]]), float(lsm[t - 1, ids[t]])
                    if math.isfinite(c) and math.isfinite(a):  # decode's prompt rows are NaN
                        got.append((eng, c, a))


def judge(pairs: Pairs | None) -> dict | None:
    """None, or {'shift': [row offset, token offset], 'fits', 'tokens', 'median_abs', 'aligned_median_abs',
    'line'} for the candidate that fits (the closest where several do)."""
    if pairs is None:
        return None
    best = None
    for key, got in pairs.pairs.items():
        if len(got) < MIN_TOKENS:
            continue
        cand = _median([abs(e - c) for e, c, _ in got])
        aligned = _median([abs(e - a) for e, _, a in got])
        stat, medians = "median", (cand, aligned)
        if aligned < BEYOND or cand > RATIO * aligned:
            # a sequence that repeats its token (a policy stuck on one) gives the neighbouring row or
            # token the aligned one's logprob there: the median is those repeats, rounding-sized, while
            # every other token is off by nats - judged by the means and the tokens the aligned one misses
            if not _fits_where_moved(got):
                continue
            cand = math.fsum(abs(e - c) for e, c, _ in got) / len(got)
            aligned = math.fsum(abs(e - a) for e, _, a in got) / len(got)
            stat = "mean"
        if best is None or cand < best[1]:
            best = (key, cand, aligned, len(got), stat, medians)
    if best is None:
        return None
    (dr, dt), cand, aligned, n, stat, medians = best
    return {"shift": [dr, dt], "tokens": n, "median_abs": medians[0], "aligned_median_abs": medians[1],
            **({"mean_abs": cand, "aligned_mean_abs": aligned} if stat == "mean" else {}),
            "line": (f"misaligned logprobs: the file's number at each generated token is {CANDIDATES[(dr, dt)]} - "
                     f"{cand:.3g} nats from it ({stat} over {n} tokens) where the token it stands beside is "
                     f"{aligned:.3g} away. An off-by-one in which token each logprob was taken for, in whatever "
                     "wrote the file (the engine's or the trainer's dump): a bug, not rounding - no setting "
                     "closes it")}


def _fits_where_moved(got) -> bool:
    """The candidate explains the tokens the aligned logprob misses (at least MIN_TOKENS of them, off
    by BEYOND or more): at 90% of them within RATIO of the aligned gap, and its mean gap over every
    token RATIO of the aligned one's. Rounding moves a neighbour's logprob as much as the aligned
    one's, so it fits neither."""
    moved = [(e, c, a) for e, c, a in got if abs(e - a) >= BEYOND]
    if len(moved) < MIN_TOKENS:
        return False
    fit = sum(1 for e, c, a in moved if abs(e - c) <= RATIO * abs(e - a))
    mean_c = math.fsum(abs(e - c) for e, c, _ in got)
    mean_a = math.fsum(abs(e - a) for e, _, a in got)
    return fit >= 0.9 * len(moved) and mean_c <= RATIO * mean_a


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
