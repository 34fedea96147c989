"""Engine-vs-trainer numbers over the generated tokens, in float64.

diff = engine - trainer per generated token.
- token_mult_prob_error: NeMo RL's, mean(exp(|diff|)); 1.0 is a perfect match.
- k3_kl: Schulman's k3 estimate of KL(engine || trainer) from the engine's own samples:
  r = p_trainer / p_engine = exp(-diff), k3 = r - 1 - log r, averaged.
"""
from __future__ import annotations

import math

# a top-2 margin (nats) this small is a near-tie whatever the noise; above it, a margin within
# twice the largest engine-trainer difference seen is one too (that much noise can flip the argmax)
NEAR_TIE_NATS = 1e-3


def pairs(seqs, trainer: list) -> list[tuple[int, int, float, float]]:
    """(sequence, position, engine, trainer) per generated token; position indexes input_ids."""
    out = []
    for i, (s, t) in enumerate(zip(seqs, trainer)):
        tl = t.tolist()
        for j, e in enumerate(s.logprobs):
            pos = s.prompt_len + j
            out.append((i, pos, float(e), float(tl[pos - 1])))
    return out


def non_finite(seqs, trainer: list, sampled: bool = False) -> str | None:
    """Why this configuration's logprobs cannot be compared (NaN/Inf where the engine has a
    number), or None. sampled: the generated tokens' rows went through --sampling's filters, where
    -inf is a token the filters removed, not a kernel's doing."""
    ps = pairs(seqs, trainer)
    bad = [(i, pos) for i, pos, _, t in ps if not math.isfinite(t)]
    cut = [(i, pos) for i, pos, _, t in ps if t == -math.inf]
    if sampled and bad and cut == bad:
        if len(cut) < len(ps):
            return None  # compared over the tokens its filters keep (summarise: filtered_out)
        i, pos = bad[0]
        return f"every generated token: {filtered_words(len(cut), seqs[i].where, pos)}"
    for i, (s, t) in enumerate(zip(seqs, trainer)):
        if s.prompt_logprobs is not None:
            tl = t.tolist()
            bad += [(i, p + 1) for p, e in enumerate(s.prompt_logprobs) if e is not None and not math.isfinite(tl[p])]
    if not bad:
        return None
    i, pos = bad[0]
    return (f"non-finite trainer logprobs (NaN/Inf) at {len(bad)} tokens, first sequence {i} position "
            f"{pos}: a kernel of this configuration produced them")


def filtered_words(n: int, where: str, pos: int) -> str:
    return (f"--sampling's filters removed the engine's sampled token at {n} token{'s' if n != 1 else ''} "
            f"(processed logprob -inf; first: {where}, position {pos}): this configuration's logits put it "
            "past a filter's edge (top_k, top_p, min_p, typical_p) where the engine's kept it - logits that "
            "differ by rounding move a token across the edge - or --sampling's settings are not the "
            "engine's. The engine's own logits under its own settings keep every token it sampled")


def same_bits(seqs, a: list, b: list) -> bool:
    """Two configurations' logprobs bitwise equal on every token the engine gave a number for."""
    import torch

    for s, x, y in zip(seqs, a, b):
        lo = 0 if s.prompt_logprobs is not None else s.prompt_len - 1
        if not torch.equal(x[lo:], y[lo:]):
            return False
    return True


# log(2^-149), float32's smallest subnormal: a logprob below it is a probability float32 cannot hold,
# so no float32 engine or trainer sampled that token - beyond any sensible range for a rollout.
LOGPROB_FLOOR = -149 * math.log(2.0)


def _mean_exp(xs: list[float], shift: float = 0.0) -> float:
    """mean(exp(x)) + shift, never an OverflowError: summed as it always was where no term can
    overflow, else in log space; +inf only where the true mean is beyond float64 (a |diff| past ~709
    nats, which beyond_range names)."""
    top = max(xs)
    if top < 700.0 - math.log(len(xs)):
        return math.fsum(math.exp(x) + shift for x in xs) / len(xs)
    lse = top + math.log(math.fsum(math.exp(x - top) for x in xs)) - math.log(len(xs))
    return math.exp(lse) + shift if lse < 709.78 else float("inf")


def _k3(d: list[float]) -> float:
    """mean(r - 1 - log r), r = exp(-x): term by term as before where exp cannot overflow."""
    if max(-x for x in d) < 700.0 - math.log(len(d)):
        return math.fsum(math.exp(-x) - 1.0 + x for x in d) / len(d)
    return max(0.0, _mean_exp([-x for x in d]) - 1.0 + math.fsum(d) / len(d))


def beyond_range(seqs, trainer: list, limit: int = 10) -> dict | None:
    """Generated tokens whose engine or trainer logprob is below LOGPROB_FLOOR: named, since every
    metric over them is dominated by a number no float32 computation gives a sampled token."""
    bad = [(i, pos, e, t) for i, pos, e, t in pairs(seqs, trainer) if LOGPROB_FLOOR > min(e, t) > -math.inf]
    if not bad:
        return None
    return {"tokens": len(bad), "floor": LOGPROB_FLOOR,
            "first": [{"sequence": i, "where": seqs[i].where, "position": pos, "engine": e, "trainer": t}
                      for i, pos, e, t in bad[:limit]]}


def summarise(seqs, trainer: list, sampled: bool = False) -> dict:
    """sampled: a token --sampling's filters removed (trainer -inf) is left out of the numbers and
    counted (filtered_out); such a configuration never reproduces the engine."""
    ps = pairs(seqs, trainer)
    cut = [p for p in ps if p[3] == -math.inf] if sampled else []
    ps = [p for p in ps if p[3] != -math.inf] if cut else ps
    n = len(ps)
    d = [e - t for _, _, e, t in ps]
    m = {"tokens": n,
         "token_mult_prob_error": _mean_exp([abs(x) for x in d]),
         "max_abs": max(abs(x) for x in d),
         "mean_diff": math.fsum(d) / n,
         "mean_abs": math.fsum(abs(x) for x in d) / n,
         "k3_kl": _k3(d),
         # the engine's number is the trainer's float32 exactly
         "exact_tokens": sum(1 for x in d if x == 0.0)}
    if cut:
        i, pos = cut[0][:2]
        m["filtered_out"] = {"tokens": len(cut), "line": filtered_words(len(cut), seqs[i].where, pos)}
    far = beyond_range(seqs, trainer)
    if far is not None:
        m["beyond_range"] = far
    prompt = _prompt(seqs, trainer)
    if prompt is not None:
        m["prompt"] = prompt
    return m


def _prompt(seqs, trainer: list) -> dict | None:
    d = []
    for s, t in zip(seqs, trainer):
        if s.prompt_logprobs is None:
            continue
        tl = t.tolist()
        d += [e - tl[p] for p, e in enumerate(s.prompt_logprobs) if e is not None]
    if not d:
        return None
    return {"tokens": len(d), "max_abs": max(abs(x) for x in d), "mean_diff": math.fsum(d) / len(d),
            "exact_tokens": sum(1 for x in d if x == 0.0)}


def near_tie_nats(noise: float) -> float:
    return max(NEAR_TIE_NATS, 2 * noise)


def worst_tokens(seqs, trainer: list, stats: dict, top: int, noise: float) -> list[dict]:
    """The `top` generated tokens with the largest |diff| (none that agree exactly), with the trainer's top-2 margin there
    (stats[(seq, pos)] from the first configuration) - near-ties flagged. `noise`: the largest
    rounding-sized |diff| (0 where the engine's logprobs are processed: not noise)."""
    ps = sorted((p for p in pairs(seqs, trainer) if p[2] != p[3] and p[3] != -math.inf),
                key=lambda p: -abs(p[2] - p[3]))[:top]
    out = []
    for i, pos, e, t in ps:
        st = stats.get((i, pos), {})
        margin = st.get("margin")
        out.append({"sequence": i, "where": seqs[i].where, "position": pos,
                    "generated_index": pos - seqs[i].prompt_len, "token_id": seqs[i].input_ids[pos],
                    "engine": e, "trainer": t, "diff": e - t, "top2_margin": margin,
                    "trainer_rank": st.get("rank"),
                    "near_tie": None if margin is None else margin <= near_tie_nats(noise)})
    return out


def reproduces(seqs, m: dict) -> bool:
    """Every generated token (and every prompt token the engine gave a number for) exact."""
    if m["exact_tokens"] != m["tokens"] or m.get("filtered_out"):
        return False
    p = m.get("prompt")
    return p is None or p["exact_tokens"] == p["tokens"]


def closeness(m: dict) -> tuple:
    """Sort key: the configuration whose numbers are nearest the engine's first."""
    return (bool(m.get("filtered_out")), m["mean_abs"], m["max_abs"])
