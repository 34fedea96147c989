"""One record pair's measures: the bit comparison, NaN/Inf judged as values, a replica's spread
across ranks, the narrower dtype a side was held in, one factor between the pair (diff/engine.py
calls it per record)."""
from __future__ import annotations

import torch

from tpdiag.diff import bits, partials
from tpdiag.records.layout import Assembled


def measure(row: dict, a: torch.Tensor, b: torch.Tensor, oa: Assembled, values: bool, scaled: bool = False) -> None:
    """The pair's bit comparison, its NaN/Inf and, for a replica whose ranks differ, how far.
    scaled: look for one factor between the pair (diff/scale.py) - in a diff of captures, where no
    float64 re-execution judges a record past the first divergence (compare's own-input pass does,
    with its verdict and distance)."""
    equal = a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits.raw_bits(a), bits.raw_bits(b))
    if equal:  # one pass on the host: most records, nothing to measure
        measure_pair(row, a, b, values, scaled, True)
    else:
        # the float64 measures of a pair that differs on the parent's check device (diff/on_device.py):
        # maxima of exact differences, IEEE quotients and integer ULP counts - the same numbers on
        # either device; the one-factor fit's sums differ in their last bits only
        from tpdiag.diff import on_device

        on_device.run(measure_pair, row, a, b, values, scaled, False)
    if oa.rank_consistent is False:
        row["rank_max_abs"] = max(
            float((s.to(torch.float64) - oa.shards[0].to(torch.float64)).abs().max())
            if s.is_floating_point() else float(not torch.equal(s, oa.shards[0]))
            for s in oa.shards)
        partials.partial_sum(row, a, oa.shards)


def measure_pair(row: dict, a: torch.Tensor, b: torch.Tensor, values: bool, scaled: bool, equal: bool) -> None:
    """The bit comparison, NaN/Inf and one-factor measures of a pair, into row (wherever a and b are)."""
    c = bits.compare(b, a, equal=equal)
    row["nonfinite_mismatch"] = c.nonfinite is not None
    row["nonfinite"] = c.nonfinite
    row.update(bitwise=c.bitwise, max_abs=c.max_abs, max_rel=c.max_rel, max_ulp=c.max_ulp,
               mismatch_fraction=c.mismatch_fraction, bound=None, beyond_bound=None)
    if values and not c.finite:  # finite: compare saw every element of both (no NaN, no Inf)
        judge_values(row, a, b)
    if not c.bitwise and not row["nonfinite_mismatch"]:
        rel = rel_l2(a, b)
        if rel is not None:
            row["rel_l2"] = rel  # not a diff.csv column: the gate's in-memory measure (diff/moved_records.cut)
        narrow = bits.narrowed_to(a, b)
        if narrow is not None:
            row["narrowed"] = narrow
    if scaled and not c.bitwise and not row["nonfinite_mismatch"] and not row.get("nonfinite_side"):
        from tpdiag.diff.scale import coherent_scale

        scale = coherent_scale(a, b)
        if scale is not None:
            row["scale"] = scale


def judge_values(row: dict, a: torch.Tensor, b: torch.Tensor) -> None:
    """NaN/Inf judged as values, not bits: bitwise comparison makes NaN equal NaN, so a loss that is
    NaN at every degree would read "bitwise". Any record holding one is a non-finite finding (never
    bitwise, max_abs infinite so that no budget passes it) naming the side(s) that hold it."""
    fwd = bits.masks_with_inf(row)
    same = row["bitwise"]  # the same bits hold the same NaN and Inf: one side's pass is enough
    va = bits.held_nonfinite(a, fwd)
    vb = va if same else bits.held_nonfinite(b, fwd)
    if not (va or vb or row["nonfinite_mismatch"]):
        return
    ha = va or bits.held_nonfinite(a)
    hb = ha if same else vb or bits.held_nonfinite(b)
    row["nonfinite_side"] = "both" if ha and hb else "reference" if ha else "degree"
    if row["nonfinite_mismatch"]:
        return
    row.update(nonfinite_mismatch=True, nonfinite=va or vb, bitwise=False, max_abs=float("inf"),
               max_rel=float("inf"), max_ulp=None)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """||b - a|| / ||a|| in float64: how far a record moved as a whole (diff/moved_records.cut: rounding moves a
    float32 record by ~1e-7, a bug by ~1); None where it is no number (a zero reference, non-float). By
    chunks, as bits.compare measures: a whole record's float64 temporaries would go through memory."""
    if a.shape != b.shape or not a.is_floating_point() or not b.is_floating_point():
        return None
    chunk = max(bits.CHUNK, bits.DEVICE_CHUNK) if a.is_cuda else bits.CHUNK
    xa, xb = a.reshape(-1), b.reshape(-1)
    ref = d = 0.0
    for s in range(0, xa.numel(), chunk):
        a64 = xa[s:s + chunk].to(torch.float64)
        ref += float(a64.square().sum())
        # not in place: .to() returns a float64 record itself
        d += float((a64 - xb[s:s + chunk].to(torch.float64)).square_().sum())
    if not (d == d and ref == ref) or ref == 0.0 or ref == float("inf"):
        return None
    return (d / ref) ** 0.5
