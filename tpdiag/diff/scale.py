"""A record that is the reference's times one factor: a scale, not a reordering.

A reordering moves each element by its own few roundings, uncorrelated with the element itself;
it never multiplies a whole tensor by one number. A loss or a grad divided by another count (the
micro-batches counted with the TP ranks, an AVG where a SUM belongs, a loss multiplied by TP)
does exactly that: b = c a, every element, with c far from 1. Such a record needs no bound to be
judged - where tpdiag has none (an activation grad, a weight grad past the first divergence in a
capture, which nothing re-executes) its layout named a reordering for a 2x grad (tests/
user_accum.py). Looked for in diffs of captures, and in compare only for the grad of an output no
module consumed (the logits of a user's own loss: nothing bounds or re-executes it there, and a
hand-written vocab-parallel loss whose backward scaled every grad read as the softmax's rounding),
and for a record whose module's float64 re-execution does not reproduce even the reference's (a
user's grad hook rescales it: diff/oracle_own.py); compare re-executes other records in float64 from
their own inputs (diff/oracle_own.py), a verdict with its distance, which it keeps. Found only where the fit is clean: |c - 1| >= 5% (bf16's unit roundoff is 0.4%;
rounding does not move a whole tensor coherently by a tenth of that) and the residual after the
scale under a tenth of the difference (rounding noise leaves a residual as large as the
difference itself); at least 16 elements (a scalar's "scale" is any difference), and at least
6 carrying a's norm (its participation ratio (sum a^2)^2 / sum a^4): a tensor whose norm is one
element's (a one-hot grad, an outlier activation) is a scalar with small values around it - its
difference is that element's own rounding, parallel to a whatever caused it. Rounding spread over k
such elements lies within the fit's tenth of a radian of a's direction with odds ~0.1^(k-1); the
logits grad of a few tokens' cross-entropy (one -1 a row) has about as many carriers as tokens.
"""
from __future__ import annotations

import torch

MIN_SCALE = 0.05     # |c - 1| at least this
MAX_RESIDUAL = 0.1   # ||b - c a|| at most this fraction of ||b - a||
MIN_ELEMENTS = 16
MIN_CARRIERS = 6     # the participation ratio of a's squares at least this
CHUNK = 1 << 18


def coherent_scale(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """c where b is c * a (a clean fit, c at least 5% from 1), else None. a, b: finite floats of one
    shape (the reference's and this side's whole tensors)."""
    if not a.is_floating_point() or a.numel() < MIN_ELEMENTS or a.shape != b.shape:
        return None
    xa, xb = a.reshape(-1), b.reshape(-1)
    aa = ab = bb = a4 = 0.0
    from tpdiag.diff.bits import DEVICE_CHUNK

    chunk = DEVICE_CHUNK if a.is_cuda else CHUNK  # a GPU's chunk: one launch and sync each
    for s in range(0, xa.numel(), chunk):
        pa, pb = xa[s:s + chunk].to(torch.float64), xb[s:s + chunk].to(torch.float64)
        sq = pa * pa
        aa += float(sq.sum())
        a4 += float(sq.dot(sq))
        ab += float(pa.dot(pb))
        bb += float(pb.dot(pb))
    return scale_of_sums(aa, ab, bb, a4, xa.numel())


def scale_of_sums(aa: float, ab: float, bb: float, a4: float, n: int) -> float | None:
    """coherent_scale from its sums (a.a, a.b, b.b, sum a^4) and a's element count: where a world
    kept only those of a value the diff never reads whole (probes/oracle_hooks.ref_norms)."""
    if n < MIN_ELEMENTS or not aa > 0 or not all(map(_finite, (aa, ab, bb, a4))) or aa * aa < MIN_CARRIERS * a4:
        return None
    c = ab / aa
    residual2 = max(bb - ab * ab / aa, 0.0)
    diff2 = max(aa - 2 * ab + bb, 0.0)
    if abs(c - 1) < MIN_SCALE or residual2 > MAX_RESIDUAL ** 2 * diff2:
        return None
    return c


# the params a diff of captures holds for their update (a pair per param, both sides whole): past
# this many bytes the later params' updates are left to the one-factor check of their values
UPDATE_BYTES = 1 << 30


class Updates:
    """Each param's value before the step, to judge the step's UPDATE (new - old) by one factor.

    A user's own optimizer in a capture whose learning rate is computed from another count or shape
    at TP > 1 (the world size taken for data-parallel replicas, a Muon-style sqrt(rows / cols) read
    from the LOCAL shard) moves each param by c times the reference's step: the new values are not
    c times the reference's (the old value dominates), so no check saw it, and every grad before it
    being bitwise or a reordering, the capture read "rounding only". A reordering of the grads moves
    each element's update by its own few roundings (an Adam step at step 0 is lr * sign(g), the
    same bits but where g is within rounding of 0; a clip coefficient's last bit is 1 + 1e-7); it
    never scales a whole update by 5% with a residual under a tenth of the difference."""

    def __init__(self):
        self.before: dict = {}
        self.bytes = 0

    def judge(self, row: dict, a: torch.Tensor, b: torch.Tensor) -> None:
        """row: a param_init or param record's row (a, b: the reference's and this side's whole
        values); a param record whose old values are held gets row["scale"] where its update is one
        factor times the reference's."""
        if not a.is_floating_point() or a.shape != b.shape:
            return
        name = (row.get("module"), row.get("name"))
        old = self.before.get(name)
        if (row.get("kind") == "param" and old is not None and old[0].shape == a.shape
                and row.get("scale") is None and not row.get("bitwise", True)):
            da = a.to(torch.float64) - old[0].to(torch.float64)
            db = b.to(torch.float64) - old[1].to(torch.float64)
            if bool(torch.isfinite(da).all()) and bool(torch.isfinite(db).all()):
                c = coherent_scale(da, db)
                if c is not None:
                    row["scale"] = c
                    row["scale_of"] = "update"
        size = 0 if old is not None else 2 * a.numel() * a.element_size()
        if old is not None or self.bytes + size <= UPDATE_BYTES:
            self.bytes += size
            self.before[name] = (a, b)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def scale_why(c: float, of: str | None = None) -> str:
    if of == "update":
        return (f"its update (this step's change of the parameter) is {c:.4g}x the reference's (one "
                "factor, the residual under a tenth of the difference): a learning rate or step "
                "computed from another count or shape (the world size, a local shard's shape) - no "
                "reordering of the grads scales a whole update")
    if of == "residual":
        return (f"the part of it that its module's float64 re-execution does not compute (a term of "
                f"the user's own: a grad hook's weight decay, a loss scale) is {c:.4g}x the "
                "reference's, the rest within rounding: that term computed another number of times at "
                "this degree (every rank adding it before the ranks' sum) - no reordering scales it")
    return (f"every element is {c:.4g}x the reference's (one factor, the residual under a tenth of the "
            "difference): a loss or grad divided or multiplied by another count - no reordering scales "
            "a whole tensor")


# the counts a scalar loss is looked for as a multiple or a fraction of: a TP degree, a world size
WHOLE_COUNTS = range(2, 65)


def whole_factor(a: float, b: float, bound: float) -> float | None:
    """n or 1/n (n a count, WHOLE_COUNTS) where the scalar b is n * a or a / n within `bound`, a's own
    rounding bound; None otherwise. A scalar's ratio to the reference is any difference (coherent_scale
    needs 16 elements); one that is a whole count, to the loss's own rounding, is a count: a loss
    divided by the world size reads exactly 1/TP (tests/models/user_tt25.py loss_world)."""
    if not (_finite(a) and _finite(b)) or abs(a) <= bound:
        return None
    for n in WHOLE_COUNTS:
        for c in (float(n), 1.0 / n):
            if abs(b - c * a) <= bound:
                return c
    return None


def factor_why(c: float | None, of: str) -> str | None:
    """Why a record beyond its bound is one factor times the reference's: a loss (whole_factor) or a
    tensor a float64 re-execution found far (coherent_scale)."""
    if c is None:
        return None
    if of == "loss":
        frac = f"{round(c)}" if c >= 1 else f"1/{round(1 / c)}"
        return (f"the loss is {frac} x the reference's, to within its rounding bound: a loss divided or "
                "multiplied by a count at this degree - a mean over the world size (the TP ranks counted "
                "as data-parallel replicas), a sum over the ranks of a loss every rank holds whole - no "
                "reordering scales a loss by a whole number")
    return (f"every element is {c:.4g}x the reference's (one factor, the residual under a tenth of the "
            "difference): a value summed over the ranks where each held it whole (a reduction applied "
            "twice: a Megatron all-reduce kept behind a DTensor style that reduces already), or divided or "
            "multiplied by a count - no reordering scales a whole tensor")


def narrowed_why(dtype: str | None) -> str | None:
    """A record beyond its rounding bound whose every element is a value of a narrower dtype
    (diff/bits.narrowed_to): precision lost to a cast at this degree, not a reordering."""
    if dtype is None:
        return None
    return (f"every element at this degree is a {dtype} value and the reference's are not: the value "
            f"was cast to {dtype} here (a collective or a copy in {dtype} where the reference keeps its "
            "dtype) - precision lost at this degree only, not a reordering; where it is meant, the cast "
            "is the difference")


def shares_why(module: str) -> str:
    """A forward input whose ranks' copies differ, of a module whose output is one value on every
    rank (diff/partials.reduced): each rank's share of the sum the module reduces, not adding up."""
    return (f"each rank's copy is its share of a sum that {module} reduces itself (its output is one "
            "value on every rank), and the shares do not add up to the reference's value: computed wrong "
            "before the reduction, not a replica left unreduced")


# the openings of the share rules' reasons (diff/judge.py; the verdicts' names, which later passes and
# the gate read, are records/share_rules.py's)
NEAR_SHARES_HEAD = "the ranks' copies add up to the reference's value to within "
DRIFTED_SHARES_HEAD = "each rank's share of a sum the backward reduces later (so shown at step "


def near_shares_why(near: dict) -> str:
    """An activation grad whose ranks' copies add up to the reference only within a few roundings of
    the tensor's largest magnitude (diff/partials.near_shares): not judged, with the reason."""
    return (f"{NEAR_SHARES_HEAD}{near['sum_max_abs']:.2e} (a single "
            f"copy is up to {near['copy_max_abs']:.2e} from it): each rank's share of a sum the backward "
            "reduces later, not a replica - but not within the rounding of each element's own magnitude, "
            "and the terms that cancel in it (a softmax backward's p (g - sum p g)) are not recorded, so "
            f"neither rounding nor a wrong share is shown (within {near['band']:.2e}, 4 roundings of the "
            "tensor's largest |shares| + |reference|, a bound that would pass a wrong share too)")


def drifted_shares_why(drifted: dict) -> str:
    """An activation grad shown each rank's share of a sum at step `shares_at`, at a later step whose
    weights differ (diff/partials.drifted_grad_shares): not judged, with the reason."""
    return (f"{DRIFTED_SHARES_HEAD}{drifted['shares_at']}), "
            "at a step whose weights differ from the reference's (each side's own optimizer update): the shares "
            "add up to this side's own sum, which the records do not hold, not the reference's - neither a "
            "replica's bug nor rounding is shown")
