"""Rounding-error bounds: how far two correct but differently-ordered computations may drift.

For y = x W^T with K-length dot products, classical analysis (Higham, Thm 3.5) gives
|fl(x.w) - x.w| <= gamma_K * |x|.|w|, gamma_K = K u / (1 - K u). Two runs may each be off by
that much, plus whatever difference they were fed (propagated exactly through |W|):
    |y_N - y_1| <= |dx| |W_N|^T + |x_1| |dW|^T + gamma_K (|x_1||W_1|^T + |x_N||W_N|^T)
                   + (T+1) u_out |x_N||W_N|^T + u_out (|y_1| + |y_N|)
The (T+1) u_out term covers TP=T rounding partial sums to the output dtype before the all-reduce.
A difference inside the bound is a reordering; far outside, the result is wrong (a sharding bug).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tpdiag.diff.bits import UNIT_ROUNDOFF


def gamma(n: int, u: float) -> float:
    nu = n * u
    return nu / (1.0 - nu) if nu < 1 else float("inf")


@dataclass(frozen=True)
class BoundCheck:
    bound: float        # the bound at the element that comes closest to (or furthest past) it
    ratio: float        # max |dy| / bound; > 1 means beyond the bound
    beyond: bool
    diff: float = 0.0   # |dy| at that element (0 where both sides hold the same value, an infinity too)

    def to_dict(self) -> dict:
        return {"bound": self.bound, "ratio": self.ratio, "beyond": self.beyond}


def linear_bound(x1, xn, w1, wn, y1, yn, world: int, b1=None, bn=None) -> torch.Tensor:
    """Elementwise bound on |yn - y1| for y = x W^T (+ b); all tensors whole (gathered)."""
    out_dtype = yn.dtype
    f = torch.float64
    u_acc = UNIT_ROUNDOFF[torch.float64 if out_dtype == torch.float64 else torch.float32]
    u_out = UNIT_ROUNDOFF.get(out_dtype, u_acc)
    x1, xn, w1, wn, y1, yn = (t.to(f) for t in (x1, xn, w1, wn, y1, yn))
    k = x1.shape[-1]
    ax1, axn, aw1, awn = x1.abs(), xn.abs(), w1.abs(), wn.abs()
    # Equal finite inputs (or weights) make a difference term a product with zeros: exactly +0
    # where the other factor is finite too, and x + 0 = x - so it is left out, and |x1||w1| is
    # |xn||wn|: the same numbers with one float64 GEMM instead of four where nothing upstream
    # moved (a second pass's forward records, mostly). Inf - Inf is NaN: not left out then.
    same_x, same_w = torch.equal(x1, xn), torch.equal(w1, wn)
    fin_x, fin_w = bool(torch.isfinite(x1).all()), bool(torch.isfinite(wn).all())
    mag_n = axn @ awn.T
    terms = []
    if not (same_x and fin_x and fin_w):
        terms.append((xn - x1).abs() @ awn.T)
    if not (same_w and fin_w and fin_x):
        terms.append(ax1 @ (wn - w1).abs().T)
    one = same_x and same_w and (ax1.stride(), aw1.stride()) == (axn.stride(), awn.stride())
    mag_1 = mag_n if one else ax1 @ aw1.T
    rounding = gamma(k, u_acc) * (mag_1 + mag_n)
    if len(terms) == 2:
        bound = terms[0] + terms[1] + rounding
    elif terms:
        bound = terms[0] + rounding
    else:
        bound = rounding
    bound = bound + (world + 1) * u_out * mag_n + u_out * (y1.abs() + yn.abs())
    if b1 is not None and bn is not None:
        bound = bound + (bn.to(f) - b1.to(f)).abs()
    return bound


def check(y1: torch.Tensor, yn: torch.Tensor, bound: torch.Tensor) -> BoundCheck:
    if y1.numel() == 0:
        # a call on no rows (an expert no token was routed to): nothing can differ
        return BoundCheck(0.0, 0.0, False)
    a, b = y1.to(torch.float64), yn.to(torch.float64)
    # equal values are no difference, equal infinities too (a logprob -inf at both sides: -inf - -inf
    # is NaN); a NaN against anything is an infinite one
    d = torch.where(a == b, torch.zeros_like(a), (b - a).abs())
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    ratio = d / bound.clamp_min(torch.finfo(torch.float64).tiny)
    ratio = torch.where(d == 0, torch.zeros_like(ratio), ratio)
    # a NaN ratio (an infinite difference against an infinite or NaN bound) is not within it: fail closed
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, float("inf")), ratio)
    i = int(ratio.argmax())
    r = float(ratio.flatten()[i])
    return BoundCheck(float(bound.flatten()[i]), r, r > 1.0, float(d.flatten()[i]))


def unmasked(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b (a pair of logits, float64) with each entry -inf at both sides set to 0 at both: a masked
    column (a padded vocabulary, a grammar mask) is the same exact 0 in each side's softmax, whatever
    the order, so it moved by nothing and has no size of its own (-inf - -inf is NaN). -inf at one
    side only stays: that is no rounding."""
    both = torch.isneginf(a) & torch.isneginf(b)
    if not bool(both.any()):
        return a, b
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(both, zero, a), torch.where(both, zero, b)


def logprob_bound(logits1, logitsn, lp1, lpn, recipe: dict | None = None) -> torch.Tensor:
    """Per-token bound on |lp_N - lp_1| for lp = logit[label] - logsumexp(logits).

    logsumexp is 1-Lipschitz in the max-norm of its input and the target logit moves by at most
    the same amount, so a logits difference d moves lp by <= 2d. Rounding: a sum of V positive
    terms (gamma_V) and an exp/log each side, in fp32; then each side's rounding of its result
    to the logprobs' own dtype (a bf16 logprob near -6 is a multiple of 2**-5).
    recipe: the trainer's logprob recipe (runner/recipe.py; world.json's keys, {} the default):
    a temperature T divides d by T, and its division rounds each logit / T (|z / T| at most the
    row's max M / T) in its dtype, moving lp by <= 2 u M / T a side; a log-softmax in the logits'
    own dtype (model-dtype) rounds its result to that dtype.
    Masked columns (a padded vocabulary, a grammar mask): a logit -inf at both sides is an exact 0 in
    each side's exp sum, whatever the order - no difference and no rounding of its own, left out of
    d and of M. A row with any other non-finite logit (-inf at one side only, +inf, NaN) is no
    rounding of the same function: its bound is 0, so any difference of its logprob is beyond it; so
    is a logprob that is not finite at both sides (equal infinities are no difference: check()).
    """
    f = torch.float64
    v = logits1.shape[-1]
    l1, ln = logits1.reshape(-1, v), logitsn.reshape(-1, v)
    # a few rows at a time: two float64 copies of a 4B model's logits are 5 GB
    rows = max(1, (1 << 20) // max(v, 1))
    d = torch.empty(l1.shape[0], dtype=f, device=l1.device)
    m = torch.empty_like(d)  # the rows' largest |logit| on either side
    wild = torch.empty(l1.shape[0], dtype=torch.bool, device=l1.device)  # rows no rounding explains
    zero = torch.zeros((), dtype=f, device=l1.device)
    for i in range(0, l1.shape[0], rows):
        a1, an = unmasked(l1[i:i + rows].to(f), ln[i:i + rows].to(f))
        wild[i:i + rows] = ~(torch.isfinite(a1) & torch.isfinite(an)).all(-1)
        d[i:i + rows] = (an - a1).abs().amax(-1)
        m[i:i + rows] = torch.maximum(a1.abs(), an.abs()).amax(-1)
    u = UNIT_ROUNDOFF[torch.float32]
    u_out = UNIT_ROUNDOFF.get(lp1.dtype, u) if lp1.dtype != torch.float64 else 0.0
    a, b = lp1.reshape(-1).to(f), lpn.reshape(-1).to(f)
    fin = torch.isfinite(a) & torch.isfinite(b)
    wild = wild | ~fin
    # the wild rows' terms as 0 (their bound is 0 below): no inf - inf or inf * 0 in the others' arithmetic
    d, m = torch.where(wild, zero, d), torch.where(wild, zero, m)
    a, b = torch.where(fin, a, zero), torch.where(fin, b, zero)
    recipe = recipe or {}
    t = float(recipe.get("trainer_temperature", 1.0))
    name, where = recipe.get("logprob", "log-softmax"), recipe.get("temperature_in", "float32")
    u_dt = UNIT_ROUNDOFF.get(logits1.dtype, u)
    out = 2 * d / t + 2 * gamma(v, u) + 4 * u * (1 + a.abs() + b.abs()) + u_out * (a.abs() + b.abs())
    if t != 1.0:
        u_div = u_dt if (where == "model" or name == "model-dtype") else u
        out = out + 2 * 2 * u_div * m / t
    if name == "model-dtype":
        # torch's 16-bit log_softmax accumulates in float32 (acc_type, CPU and CUDA) and rounds its
        # result to the logits' dtype: each side's rounding of its logprob (one ULP of slack)
        out = out + u_dt * (1 + a.abs() + b.abs())
    return torch.where(wild, zero, out)


def mean_bound(elem_bound: torch.Tensor, y1: float, yn: float, n: int,
               out_dtype: torch.dtype = torch.float32) -> float:
    """Bound on the difference of two means of n terms each within elem_bound of each other,
    each side's mean rounded to out_dtype."""
    u = UNIT_ROUNDOFF[torch.float32]
    u_out = max(u, UNIT_ROUNDOFF.get(out_dtype, u))
    return float(elem_bound.mean()) + gamma(n, u) * (abs(y1) + abs(yn)) + u_out * (abs(y1) + abs(yn))


def _sum_sq(a: torch.Tensor) -> float:
    return float((a.to(torch.float64) ** 2).sum())


def _sum_sq_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    f = torch.float64
    return float(((b.to(f) - a.to(f)) ** 2).sum())


def _sums_of_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """_sum_sq(a), _sum_sq(b), _sum_sq_diff(a, b): the same float64 expressions, each side
    converted once (norm_own_errors' and norm_bound's own calls convert - on a GPU copy - each side
    twice: every grad of the captured modules read twice per side)."""
    f = torch.float64
    a64, b64 = a.to(f), b.to(f)
    return float((a64 ** 2).sum()), float((b64 ** 2).sum()), float(((b64 - a64) ** 2).sum())


def grad_sums(grads1: list, gradsn: list) -> list:
    """[(sum of squares of g1, of gn, of gn - g1)] per grad pair in float64, on the parent's check
    device where it has one (diff/on_device.py): what norm_bound and norm_own_errors sum, read once
    for both. A pair of two dtypes is measured as each function measures it alone: its tensors may
    sit on either side of on_device's size floor, each then on the device it ran on before."""
    from tpdiag.diff import on_device

    return [on_device.run(_sums_of_pair, a, b) if a.dtype == b.dtype else
            (on_device.run(_sum_sq, a), on_device.run(_sum_sq, b), on_device.run(_sum_sq_diff, a, b))
            for a, b in zip(grads1, gradsn)]


def norm_own_errors(grads1: list, gradsn: list, total1: float, totaln: float, sums: list | None = None) -> dict:
    """Each side's grad norm against the float64 norm of ITS OWN recorded grads - the local
    oracle of a reduction: a norm that read the wrong grads (a shard missing, a replica counted
    twice, no all-reduce) is far from its own grads' exact norm, while a faithful one is off by
    its own rounding only, whatever order its device summed in. The triangle bound below models
    that rounding (log2 n deep sums); a GPU's reduce kernel sums long serial runs per thread, and
    accumulation over micro-batches changes the grads, not the norm's own error.
    far: this side's error is beyond A x the reference's own error (floored at the log2-depth
    rounding of the norm), A = 8 as for any one-output float64 verdict.
    sums: grad_sums(grads1, gradsn), where the caller made them (None: made here)."""
    import math

    from tpdiag.diff import on_device

    # float64 sums of squares on the parent's check device where it has one (diff/on_device.py)
    if sums is not None:
        e1, en = math.sqrt(sum(s[0] for s in sums)), math.sqrt(sum(s[1] for s in sums))
    else:
        e1 = math.sqrt(sum(on_device.run(_sum_sq, a) for a in grads1))
        en = math.sqrt(sum(on_device.run(_sum_sq, b) for b in gradsn))
    err1, errn = abs(total1 - e1), abs(totaln - en)
    n = max(sum(a.numel() for a in grads1), 2)
    floor = (gamma(math.ceil(math.log2(n)) + 1, UNIT_ROUNDOFF[torch.float32])
             + 2 * UNIT_ROUNDOFF[torch.float32]) * max(abs(e1), abs(en))
    threshold = 8.0 * max(err1, floor)
    return {"exact_reference": e1, "exact_this": en, "err_reference": err1, "err_this": errn,
            "threshold": threshold, "far": not (errn <= threshold)}


def norm_bound(grads1: list, gradsn: list, total1: float, totaln: float, sums: list | None = None) -> float:
    """|norm_N - norm_1| <= ||g_N - g_1||_2 (triangle inequality) + each side's rounding of a
    sum of squares over n elements (gamma_n, relative) and the square root.
    sums: grad_sums(grads1, gradsn), where the caller made them (None: made here)."""
    import math

    from tpdiag.diff import on_device

    diff2 = (sum(s[2] for s in sums) if sums is not None else
             sum(on_device.run(_sum_sq_diff, a, b) for a, b in zip(grads1, gradsn)))

    n = sum(a.numel() for a in grads1)
    u = UNIT_ROUNDOFF[torch.float32]
    # torch sums long vectors pairwise/cascaded (CPU) or by trees (GPU): the error grows with
    # log2(n), not n; the worst-case gamma_n over a million grads would hide a 5% error
    depth = math.ceil(math.log2(max(n, 2))) + 1
    return diff2 ** 0.5 + (gamma(depth, u) + 2 * u) * (abs(total1) + abs(totaln))
