"""bits.compare measures a divergent pair over the whole tensors where a quarter or more of the
elements differ, over the gathered mismatches otherwise: every measure is 0 where the bits agree,
so both give the same numbers - equal NaN, Inf and -0.0 at both sides included. And ordered_int's
branch-free sign handling is the float order, ±0 at 0."""
import pytest
import torch

from tpdiag.diff import bits

SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("with_nan", [False, True])
def test_whole_and_gathered_paths_agree(dtype, with_nan):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, generator=g)
    b = a + torch.randn(40, generator=g) * 1e-2
    if with_nan:  # a NaN against a number among the mismatches
        b[5] = float("nan")
    # the same specials at both sides: equal bits, so no mismatch - but NaN - NaN is NaN and
    # inf - inf is NaN in a whole-tensor pass
    same = torch.tensor(SPECIALS * 2)
    a, b = torch.cat([a, same]).to(dtype), torch.cat([b, same]).to(dtype)
    pad = torch.cat([torch.randn(2000, generator=g), torch.tensor(SPECIALS)]).to(dtype)
    whole = bits.compare(a, b)  # 40 of 50 differ: the whole-tensor pass
    gathered = bits.compare(torch.cat([a, pad]), torch.cat([b, pad]))  # 40 of 2055: gathered
    assert whole.mismatches == gathered.mismatches == int((bits.raw_bits(a) != bits.raw_bits(b)).sum())
    assert whole.mismatches * 4 >= whole.numel and gathered.mismatches * 4 < gathered.numel
    for f in ("max_abs", "max_rel", "max_ulp", "nan_mismatch", "bitwise"):
        assert getattr(whole, f) == getattr(gathered, f), f
    assert whole.nan_mismatch == with_nan and (whole.max_ulp is None) == with_nan
    if not with_nan:
        d = (a.double() - b.double()).abs()
        assert whole.max_abs == float(d[:40].max())  # not NaN from the equal specials
        assert whole.max_ulp == int(bits.ulp_distance(a[:40], b[:40]).max()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn])
def test_ordered_int_is_the_float_order(dtype):
    x = torch.cat([torch.randn(500) * 10, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0])]).to(dtype)
    x = x[~torch.isnan(x)]
    o = bits.ordered_int(x)
    assert int(bits.ordered_int(torch.tensor([-0.0, 0.0]).to(dtype)).abs().sum()) == 0
    xs, idx = torch.sort(x.double(), stable=True)
    os_ = o[idx]
    assert bool((os_[1:] >= os_[:-1]).all())  # monotone
    assert bool(((os_[1:] == os_[:-1]) == (xs[1:] == xs[:-1])).all())  # equal values, equal ints (±0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_finite_only_where_the_pass_saw_every_element_finite(dtype):
    """Compare.finite lets the diff skip its own non-finite passes over both tensors
    (diff/measure.judge_values): it must be True only where the whole-tensor pass saw every element of
    both sides finite - never with a NaN or Inf that both sides hold (equal bits, no mismatch)."""
    from tpdiag.diff import measure

    g = torch.Generator().manual_seed(5)
    a = torch.randn(4000, generator=g)
    b = a + torch.randn(4000, generator=g) * 1e-2
    a, b = a.to(dtype), b.to(dtype)
    assert bits.compare(a, b).finite and bits.compare(a, b, chunk=256).finite
    for special in SPECIALS[:3]:  # the same NaN / Inf at both sides, the rest differs
        sa, sb = a.clone(), b.clone()
        sa[17] = sb[17] = special
        c = bits.compare(sa, sb, chunk=256)
        assert c.mismatches * 4 >= c.numel and not c.finite and not c.nan_mismatch
        row = {"phase": "backward"}
        measure.measure_pair(row, sa, sb, values=True, scaled=False, equal=False)
        assert row["nonfinite_side"] == "both" and row["nonfinite_mismatch"] and not row["bitwise"]
    few = b.clone()
    few[100:] = a[100:]  # 100 of 4000 differ: gathered, the equal elements unseen
    assert not bits.compare(a, few).finite
    assert not bits.compare(a, a.clone()).finite  # bitwise: nothing measured
    assert "finite" not in bits.compare(a, b).to_dict()
    row = {"phase": "backward"}
    measure.measure_pair(row, a, b, values=True, scaled=False, equal=False)
    assert "nonfinite_side" not in row and not row["nonfinite_mismatch"] and row["max_abs"] > 0
