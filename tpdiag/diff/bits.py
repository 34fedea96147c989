"""Bit-level comparison: raw-bit equality, ULP distance per dtype, abs/rel error, mismatch fraction.

Raw bits, not torch.equal: -0.0 vs +0.0 and different NaN payloads are differences, and NaN
equals NaN when the bits are the same.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

_INT_VIEW = {
    torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
    torch.float16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8,
}
# unit roundoff u = 2^-p (p = significand bits incl. the implicit one)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}


@dataclass(frozen=True)
class Compare:
    bitwise: bool
    numel: int
    mismatches: int
    max_abs: float
    max_rel: float
    max_ulp: int | None  # None: not a float dtype, or NaN/Inf pattern differs
    nan_mismatch: bool
    # every element of both tensors seen finite by the measures themselves (a whole-tensor pass
    # whose every |a - b| was finite: a NaN or Inf at either side makes its |a - b| NaN or Inf);
    # False: not known. Lets the caller skip its own non-finite passes (measure.judge_values)
    finite: bool = False

    @property
    def nonfinite(self) -> str | None:
        """'NaN' or 'Inf' where one side is non-finite and the other is not (its own finding), else None."""
        if self.nan_mismatch:
            return "NaN"
        return "Inf" if self.max_abs == float("inf") else None

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatches / self.numel if self.numel else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("finite")  # what the pass saw, not a measure
        d["mismatch_fraction"] = self.mismatch_fraction
        return d


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype in _INT_VIEW:
        return t.view(_INT_VIEW[t.dtype])
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


def masks_with_inf(row: dict) -> bool:
    """Whether -inf in this record may be a mask, not a value gone wrong: a forward record (an attention
    mask's additive -inf bias) or the loss phase's logits - a padded or masked vocabulary's columns,
    whose exp is an exact 0 in any order. Either is a softmax's input; where the mask is wrong, the
    loss, a gradient or an update is judged (and -inf at one side only is compare's Inf mismatch)."""
    return row.get("phase") == "forward" or row.get("kind") == "logits"


def held_nonfinite(t: torch.Tensor, forward: bool = False) -> str | None:
    """'NaN' or 'Inf' where the tensor holds one as a value, else None - whatever the other side holds:
    a loss that is NaN at every degree is bitwise equal and still wrong. In a forward record -inf
    alone is not one: attention masks are built with it (an additive -inf bias, softmax's input), and
    where it is wrong it reaches a loss, a gradient or an update, which are judged. forward: any
    record whose -inf may be a mask (masks_with_inf: the loss phase's logits too)."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    if bool(torch.isfinite(t).all()):  # the common case in one pass
        return None
    if bool(torch.isnan(t).any()):
        return "NaN"
    if bool(torch.isposinf(t).any()) or (not forward and bool(torch.isneginf(t).any())):
        return "Inf"
    return None


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bits(a), raw_bits(b))


def ordered_int(t: torch.Tensor) -> torch.Tensor:
    """Map float bits to integers whose order is the float order (±0 both map to 0)."""
    width = torch.finfo(t.dtype).bits
    # 16-bit floats in int32 (half the bytes through memory; a distance fits), wider in int64
    bits = raw_bits(t).to(torch.int32 if width <= 16 else torch.int64)
    # the raw view is signed, so the widened word is negative exactly where the float's sign bit
    # is set: s = -1 there, else 0, and (mag ^ s) - s is -mag or mag without a branch per element
    # (torch.where on random signs ran ~10x slower: mispredicted branches)
    s = bits >> (bits.element_size() * 8 - 1)
    if bits.data_ptr() == t.data_ptr():  # no copy was made (int64 data of float64): not in place
        bits = bits & ((1 << (width - 1)) - 1)
    else:
        bits.bitwise_and_((1 << (width - 1)) - 1)
    return bits.bitwise_xor_(s).sub_(s)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values between a and b, elementwise (int32 for 16-bit floats,
    else int64)."""
    return ordered_int(a).sub_(ordered_int(b)).abs_()


# Elements compared per float64 pass: a record's whole-tensor float64 temporaries (a dozen of
# them, 8 bytes an element) go through memory; a chunk's stay in cache.
CHUNK = 1 << 18


# On a GPU a chunk's temporaries are far from its memory's size, and each chunk costs a launch
# and a sync: 64 Mi elements (512 MiB a float64 temporary)
DEVICE_CHUNK = 1 << 26


def compare(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK, equal: bool | None = None) -> Compare:
    """equal: the caller's own torch.equal of the raw bits, where it made one (None: made here)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{list(a.shape)} with {b.dtype}{list(b.shape)}")
    n = a.numel()
    if a.is_cuda:
        chunk = max(chunk, DEVICE_CHUNK)
    if equal if equal is not None else torch.equal(raw_bits(a), raw_bits(b)):  # one pass, no temporaries: most records
        return Compare(True, n, 0, 0.0, 0.0, 0 if a.is_floating_point() else None, False)
    diff = (raw_bits(a) != raw_bits(b)).reshape(-1)
    mism = int(diff.sum())
    if mism == 0:
        return Compare(True, n, 0, 0.0, 0.0, 0 if a.is_floating_point() else None, False)
    if not a.is_floating_point():
        # complex (a RoPE product's op record): the modulus of the difference - a cast to float64
        # kept the real parts alone, and a difference in the imaginary ones read smaller or 0
        up = torch.complex128 if a.is_complex() else torch.float64
        d = (a.to(up) - b.to(up)).abs()
        return Compare(False, n, mism, float(d.max()), float((d / b.to(up).abs().clamp_min(1)).max()),
                       None, False)
    # Every measure below is 0 (or False) where the bits are equal - same bits, same value, same
    # NaN-ness - and is a max or an any: the mismatching elements alone give the same answer, and
    # so do the whole tensors. Gathering the mismatches costs about what a pass over the equal
    # elements saves once a quarter of them differ (and most divergent records differ almost
    # everywhere): the whole tensors then.
    whole = mism * 4 >= n
    if whole:
        xa, xb = a.reshape(-1), b.reshape(-1)
    else:
        at = diff.nonzero().squeeze(1)
        xa, xb = a.reshape(-1).index_select(0, at), b.reshape(-1).index_select(0, at)
    nan_mismatch = inf_pattern = False
    max_abs = max_rel = 0.0
    max_ulp = 0
    finite = True
    for s in range(0, xa.numel(), chunk):
        m = _mismatch_stats(xa[s:s + chunk], xb[s:s + chunk])
        nan_mismatch |= m[0]
        inf_pattern |= m[1]
        max_abs, max_rel, max_ulp = max(max_abs, m[2]), max(max_rel, m[3]), max(max_ulp, m[4])
        finite = finite and m[5]
    if inf_pattern or nan_mismatch:
        # NaN against a number is no small difference: an infinite one, so that no budget on max_abs
        # can pass it (the NaN elements themselves drop out of the finite measures above).
        max_abs = max_rel = float("inf")
    return Compare(False, n, mism, max_abs, max_rel, None if nan_mismatch else max_ulp, nan_mismatch,
                   whole and finite)


def _mismatch_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, bool, float, float, int, bool]:
    """(NaN pattern differs, an Inf differs, max |a - b| and max relative error over finite
    differences, max ULP distance where neither is NaN, every |a - b| finite) of flat float
    tensors."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    d = (a64 - b64).abs_()
    d_max = float(d.max())
    if math.isfinite(d_max):
        # every |a - b| finite: no NaN or Inf at either side (one makes its |a - b| NaN or Inf) -
        # most mismatches. The masks below are then all true and their where()s the identity:
        # the same numbers in fewer passes. In place on the float64 temporaries (a chunk's
        # allocations were a fifth of this on the CPU); b64 is b itself for float64 data
        den = b64.abs_() if b64 is not b else b64.abs()
        rel = d.div_(den.clamp_min_(torch.finfo(a.dtype).tiny))
        return False, False, d_max, float(rel.max()), int(ulp_distance(a, b).max()), True
    nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
    nan_mismatch = bool((nan_a != nan_b).any())
    both = ~(nan_a | nan_b)
    d = torch.where(both, d, torch.zeros_like(d))
    inf_pattern = bool(((torch.isinf(a64) | torch.isinf(b64)) & (a64 != b64) & both).any())
    finite_d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    rel = finite_d / b64.abs().where(both, torch.ones_like(b64)).clamp_min(torch.finfo(a.dtype).tiny)
    # NaN vs NaN with different payloads: a mismatch, not an ULP distance
    u = torch.where(both, ulp_distance(a, b), 0)
    return nan_mismatch, inf_pattern, float(finite_d.max()), float(rel.max()), int(u.max()), False


# at least this many nonzero elements before a record is read as held in a narrower dtype, and at
# most this share of the reference's nonzero elements already representable in it
NARROW_MIN, NARROW_REF_SHARE = 16, 0.5
# the leading elements of this side's record looked at first (narrowed_to)
NARROW_PROBE = 4096


def narrowed_to(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """The narrower dtype ("bfloat16", "float16") every element of b - this side's record, float32
    or float64 - is a value of while most of the reference a's elements are not: this degree cast
    the value to that dtype (a collective or an activation kept in bfloat16 where the reference
    keeps float32). A reordering keeps the record's own precision; a cast loses it, which the
    rounding bound of the record's dtype reads as a wrong result - this says which one it is."""
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float64) or a.shape != b.shape:
        return None
    # every element of b must be a value of the narrower dtype: one of its leading elements that is
    # not rules that dtype out exactly, with no pass over the whole record - most divergent records
    # (a float32 reordering) are ruled out here, where a dozen whole passes per record had added half
    # again to compare()'s own cost
    head = b.reshape(-1)[:NARROW_PROBE]
    dts = [(dt, name) for dt, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"))
           if bool((head.to(dt).to(b.dtype) == head).all())]
    if not dts:
        return None
    nz_b, nz_a = b != 0, a != 0
    if int(nz_b.sum()) < NARROW_MIN or int(nz_a.sum()) < NARROW_MIN:
        return None
    for dt, name in dts:
        if not bool(torch.isfinite(b).all()) or not bool((b.to(dt).to(b.dtype) == b).all()):
            continue
        held = (a.to(dt).to(a.dtype) == a) & nz_a
        if float(held.sum()) <= NARROW_REF_SHARE * float(nz_a.sum()):
            return name
    return None
