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


def test_inf_vs_finite_is_infinite_error():
    c = compare(torch.tensor([float("inf")]), torch.tensor([1.0]))
    assert not c.bitwise and c.max_abs == float("inf")
