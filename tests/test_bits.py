import math

import pytest
import torch

from tpdiag.diff.bits import bitwise_equal, compare, ulp_distance


def test_signed_zero_is_a_difference_that_torch_equal_misses():
    a, b = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(a, b)  # the trap
    assert not bitwise_equal(a, b)
    c = compare(a, b)
    assert not c.bitwise and c.mismatches == 1 and c.max_abs == 0.0


def test_nan_same_bits_equal_nan_vs_number_not():
    n = torch.tensor([float("nan"), 1.0])
    assert not torch.equal(n, n.clone())  # the other trap
    assert bitwise_equal(n, n.clone())
    c = compare(n, torch.tensor([1.0, 1.0]))
    assert not c.bitwise and c.nan_mismatch and c.max_ulp is None


def test_nan_payloads_differ():
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert math.isnan(float(a)) and math.isnan(float(b))
    assert not bitwise_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_distance_counts_representable_steps(dtype):
    x = torch.tensor([1.0, -1.0, 0.0], dtype=dtype)
    up = torch.nextafter(x.float(), torch.tensor(2.0)).to(dtype) if dtype == torch.float32 else None
    eps = torch.finfo(dtype).eps
    y = torch.tensor([1.0 + eps, -1.0 - eps, 0.0], dtype=dtype)
    assert ulp_distance(x, y).tolist() == [1, 1, 0]
    if up is not None:
        assert ulp_distance(x[:1], up[:1]).item() == 1
    # across zero: smallest subnormals on both sides are 2 steps apart
    tiny = torch.finfo(dtype).smallest_normal * eps
    s = torch.tensor([tiny, -tiny], dtype=dtype)
    assert ulp_distance(s[:1], s[1:]).item() == 2


def test_compare_metrics():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = a.clone()
    b[2] = torch.nextafter(b[2], torch.tensor(10.0))
    c = compare(b, a)
    assert not c.bitwise and c.mismatches == 1 and c.mismatch_fraction == 0.25
    assert c.max_ulp == 1 and c.max_abs == pytest.approx(2 ** -22, rel=0)


def test_nan_vs_number_is_an_infinite_error_never_zero():
    # a NaN at one side only used to read max_abs 0.0: a budget on max_abs passed it
    c = compare(torch.tensor([float("nan"), 1.0]), torch.tensor([2.0, 1.0]))
    assert c.max_abs == float("inf") and c.max_rel == float("inf") and c.nonfinite == "NaN"
    assert compare(torch.tensor([float("inf")]), torch.tensor([1.0])).nonfinite == "Inf"
    assert compare(torch.tensor([1.5]), torch.tensor([1.0])).nonfinite is None


def test_inf_vs_finite_is_infinite_error():
    c = compare(torch.tensor([float("inf")]), torch.tensor([1.0]))
    assert not c.bitwise and c.max_abs == float("inf")


def _whole_tensor_compare(a, b):
    """The measures over whole tensors in float64, as compare computed them before it chunked."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
    nan_mismatch = bool((nan_a != nan_b).any())
    both = ~(nan_a | nan_b)
    d = torch.where(both, (a64 - b64).abs(), 0.0)
    inf_pattern = bool(((torch.isinf(a64) | torch.isinf(b64)) & (a64 != b64) & both).any())
    fd = torch.where(torch.isfinite(d), d, 0.0)
    rel = fd / b64.abs().where(both, torch.ones_like(b64)).clamp_min(torch.finfo(a.dtype).tiny)
    u = torch.where(both, ulp_distance(a, b), 0)
    inf = float("inf")
    big = inf_pattern or nan_mismatch  # NaN against a number is an infinite difference, never 0
    return (inf if big else float(fd.max()), inf if big else float(rel.max()),
            None if nan_mismatch else int(u.max()), nan_mismatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_chunked_compare_equals_whole_tensor_measures(dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3000, generator=g).to(dtype)
    b = a.clone()
    b[::7] = torch.randn(len(b[::7]), generator=g).to(dtype)
    variants = [b]
    for i, v in ((5, float("nan")), (14, float("inf")), (21, -float("inf"))):
        c = b.clone()
        c[i] = v
        variants.append(c)
    c = b.clone()
    c[0] = -a[0]  # a sign flip
    variants.append(c)
    # NaN against NaN of another payload: a mismatch, with no ULP distance
    nan_a = a.clone()
    nan_a[9] = float("nan")
    c = nan_a.clone()
    bits = c.view(torch.int16 if c.element_size() == 2 else torch.int32 if c.element_size() == 4 else torch.int64)
    bits[9] ^= 1
    pairs = [(a, v) for v in variants] + [(nan_a, c)]
    seen = set()
    for x, v in pairs:
        want = _whole_tensor_compare(x, v)
        for chunk in (37, 1 << 18):
            r = compare(x, v, chunk=chunk)
            assert (r.max_abs, r.max_rel, r.max_ulp, r.nan_mismatch) == want, (dtype, chunk)
        seen.add(want[2] is None)
    assert seen == {True, False}  # both the ULP and the NaN-pattern branches ran
    r = compare(nan_a, c, chunk=37)
    assert (r.mismatches, r.max_ulp, r.max_abs, r.nan_mismatch) == (1, 0, 0.0, False)


def test_complex_difference_is_its_modulus_imaginary_parts_included():
    # a RoPE's complex product is an op record (probes/op_probe.py): a cast to float64 kept the
    # real parts alone, so a difference in the imaginary parts read max_abs 0
    a = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)
    b = a.clone()
    b[1] = 2 + 2.5j
    c = compare(a, b)
    assert not c.bitwise and c.mismatches == 1 and c.max_abs == 0.5, c
    b[0] = 1.5 + 1j
    assert compare(a, b).max_abs == 0.5
    b[1] = 2.3 + 2.4j  # (0.3, 0.4): modulus 0.5
    assert math.isclose(compare(a, b).max_abs, 0.5, rel_tol=1e-6)
