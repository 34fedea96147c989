"""A term of the user's loss that does not depend on the label (a z-loss, an entropy bonus), told
from a wrong logprob by labelling the same token otherwise.

own_loss reads -loss with one generated token labelled as that token's logprob. A loss that adds
R, a function of the rows and of which positions are labelled but not of the labels' values
(PaLM's z-loss 1e-4 * logsumexp(logits)**2 over the kept tokens, an entropy bonus, a KL to a
reference over whole distributions), gives -loss(k) = lp(k) - R: off from the float64 log-softmax
by R at every token, though its logprobs are right. R is the same at every label k of that
position - the same rows, the same mask, the same bits - so the offset -loss(k) - lp64(k) stays put
when the token is labelled k' instead, where a wrong logprob moves it: a label shifted twice reads
another row (its offset lp_{t-1}(k) - lp_t(k) depends on k), a temperature scales z_k - z_k', a
log-softmax over the sequence subtracts a per-column normaliser, a scaled NLL scales the
difference. k' is the row's least likely token (the furthest label difference from a sampled token)
and its most likely one other than k.

Why not a call with every label -100 (R alone): a token-mean of no labelled token is 0/0 - torch's
F.cross_entropy with every label ignored is NaN, and a z-loss averaged over the kept tokens too -
so that call says nothing for the commonest loss; relabelling keeps the one-token mean exact.

Rounding: each -loss(k) is the loss's own logprob of k (within `bound`, the float32 log-softmax's
rounding bound own_loss gives it) with R added in the loss's dtype - one more rounding, at most
u |loss(k)| (the add is the last operation on it: a sum of zeros and one term, and a division by one
kept token, are exact). R's own rounding is the same bits at k and k' and cancels. The offsets are
differenced in float64 (math.fsum: within 2**-53 of the exact difference). So where the logprob term
is the log-softmax, |offset(k) - offset(k')| <= bound(k) + bound(k') + u (|loss(k)| + |loss(k')|),
plus that float64 rounding. Anything not depending on the label reads as R - a normaliser off by a
per-row constant too: the check says the loss's label differences are the log-softmax's, not that
its -loss is a logprob.
"""
from __future__ import annotations

import math

U64 = 2.0 ** -53


def alternatives(lsm64, token: int) -> list[int]:
    """Other labels for the token's position: the row's least likely token and its most likely
    other than `token` (lsm64: the row's float64 log-softmax)."""
    import torch

    order = torch.argsort(lsm64, descending=True, stable=True).tolist()
    top = next(k for k in order if k != token)
    low = next(k for k in reversed(order) if k != token)
    return list(dict.fromkeys([low, top]))


def judge(minus_loss, lsm64, token: int, own, bound: float, bound_of) -> dict:
    """{'label_free' (the offset is the same at every label tried, within rounding), 'term' (own -
    float64 at `token`, nats: R where label_free), 'ratio' (the largest move of the offset over its
    bound), 'relabelled': [{token, own, float64, moved, bound, ratio}]}. minus_loss(k): -loss with
    the position labelled k, a 0-d tensor in the loss's dtype; own: minus_loss(token);
    bound_of(own_k, ref_k): own_loss's rounding bound of -loss(k) against the float64 logprob."""
    from tpdiag.diff.bits import UNIT_ROUNDOFF

    u = UNIT_ROUNDOFF[own.dtype]  # the loss's dtype: where R is added to the logprob term
    a, ref = float(own), float(lsm64[token])
    tried = []
    for k in alternatives(lsm64, token):
        own_k = minus_loss(k)
        b, ref_k = float(own_k), float(lsm64[k])
        moved = math.fsum([a, -ref, -b, ref_k])
        pair = (bound + bound_of(own_k, ref_k) + u * (abs(a) + abs(b))
                + U64 * (abs(a) + abs(ref) + abs(b) + abs(ref_k)))
        tried.append({"token": k, "own": b, "float64": ref_k, "moved": moved, "bound": pair,
                      "ratio": abs(moved) / pair if math.isfinite(moved) else math.inf})
    worst = max(tried, key=lambda t: t["ratio"] if not math.isnan(t["ratio"]) else math.inf)
    return {"label_free": all(t["ratio"] <= 1 for t in tried), "term": math.fsum([a, -ref]),
            "ratio": worst["ratio"], "relabelled": tried}
