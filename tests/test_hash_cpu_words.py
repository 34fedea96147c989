"""The CPU lanes in numpy uint32 arithmetic (kernels/record_hash_ref._lanes_numpy: lanes_fast's CPU
loop and tensor_hash's whole-tensor path) are the definition's bit for bit: lanes_torch's (int64
torch ops) and the plain-Python reference, for every dtype width, both lane mixes, shards at an
offset (k past 2**32 included) and chunks shorter than a slab."""
import pytest
import torch

from tpdiag.kernels import record_hash_ref as R
from tpdiag.kernels.record_hash import shard_lanes, slab
from tpdiag.records.hashing import hash_of_lanes, tensor_hash

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64)


def _sample(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g) * 1e3
        x.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0])[:x.numel()]
        return x.to(dtype)
    return torch.randint(-128 if dtype.is_signed else 0, 127, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_lanes_match_torch_lanes(dtype):
    for shape, dim, full, offset in (((0,), None, None, 0), ((5,), None, None, 0), ((7, 9), 1, 27, 9),
                                     ((7, 9), 0, 21, 7), ((3, 4, 5), 1, 8, 4), ((2, 3), 1, 1 << 31, (1 << 31) - 3)):
        t = _sample(dtype, shape)
        a, L, b, F, o = slab(t.shape, dim, full, offset)
        for mix in R.MIXES:
            want = R.lanes_torch(t, a, L, b, F, o, mix=mix)[0]
            for chunk in (R.CHUNK, 4):
                got = R.lanes_fast(t, a, L, b, F, o, mix=mix, chunk=chunk)[0]
                assert torch.equal(got[:2], want[:2] & R.M32), (shape, dim, mix, chunk)
                assert torch.equal(got[2:], want[2:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_hash_is_the_shard_lanes_hash(dtype):
    for shape in ((0,), (3,), (4, 5), (33, 7)):
        t = _sample(dtype, shape)
        for mix in R.MIXES:
            la, lb = R.reference_lanes(t, mix)
            assert R.whole_lanes(t, mix) == (la, lb)
            want = hash_of_lanes(la, lb, str(t.dtype), list(t.shape))
            assert tensor_hash(t, mix) == want
            ints, _ = shard_lanes(t, mix=mix, stats=False)
            assert hash_of_lanes(*(int(v) for v in ints[:2].tolist()), str(t.dtype), t.shape) == want
            if t.dim() == 2:  # a non-contiguous view hashes as its logical order
                assert tensor_hash(t.t(), mix) == tensor_hash(t.t().contiguous(), mix)
