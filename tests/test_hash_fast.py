"""The CPU path's chunked record hash (record_hash_ref.lanes_fast) against the definition it must
match (lanes_torch, itself checked against plain Python): the lanes, the non-finite count and the
max |x| bit for bit, for every dtype, shard layout, chunk boundary and mix."""
from __future__ import annotations

import pytest
import torch

from tpdiag.kernels import record_hash as rh
from tpdiag.kernels.record_hash_ref import lanes_fast, lanes_torch, reference_lanes
from tpdiag.records.hashing import hash_of_lanes, tensor_hash


def _tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 37, 11, generator=g)
    x[1, 3, 4], x[2, 5, 6], x[4, 0, 0] = float("nan"), float("inf"), -float("inf")
    yield x
    yield x.to(torch.bfloat16)
    yield x.to(torch.float16)
    yield x.to(torch.float64)
    yield (x * 1000).nan_to_num().to(torch.int64)
    yield x > 0
    yield torch.randint(0, 256, (6, 37, 11), generator=g, dtype=torch.uint8)
    y = torch.randn(6, 37, 11, generator=g)
    yield torch.complex(y, 2 * y)


def _cases(t):
    yield rh.slab(t.shape, None, None, 0), t
    for dim in range(t.dim()):
        n = t.shape[dim]
        part = t.narrow(dim, n // 3, n - n // 3).contiguous()
        yield rh.slab(part.shape, dim, n, n // 3), part


@pytest.mark.parametrize("mix", [1, 2])
def test_lanes_fast_equals_definition(mix):
    checked = 0
    for t in _tensors():
        for args, part in _cases(t):
            want_i, want_f = lanes_torch(part, *args, mix=mix)
            for chunk in (7, 64, 1 << 18):  # chunk edges inside slabs, rows and 8-byte elements
                got_i, got_f = lanes_fast(part, *args, mix=mix, chunk=chunk)
                assert torch.equal(got_i, want_i), (part.dtype, args, chunk)
                # the float64 sums add in another order: equal to rounding
                torch.testing.assert_close(got_f, want_f, rtol=1e-12, atol=1e-9)
                checked += 1
    assert checked == 8 * 4 * 3


def test_lanes_fast_sees_a_wrong_position():
    # negative control: the same comparison fails for a shard placed one element off
    t = torch.randn(4, 50)
    part = t[:, 10:].contiguous()
    want, _ = lanes_torch(part, *rh.slab(part.shape, 1, 50, 10))
    for chunk in (7, 1 << 18):
        got, _ = lanes_fast(part, *rh.slab(part.shape, 1, 50, 11), chunk=chunk)
        assert not torch.equal(got[:2], want[:2])


def test_tensor_hash_on_cpu_is_the_definition():
    for t in _tensors():
        la, lb = reference_lanes(t)
        assert tensor_hash(t) == hash_of_lanes(la, lb, str(t.dtype), t.shape)
        assert tensor_hash(t, 1) == hash_of_lanes(*reference_lanes(t, 1), str(t.dtype), t.shape)
    assert tensor_hash(torch.zeros(0)) == hash_of_lanes(0, 0, "torch.float32", (0,))
    assert tensor_hash(torch.tensor(2.5)) == hash_of_lanes(*reference_lanes(torch.tensor(2.5)),
                                                           "torch.float32", ())


@pytest.mark.parametrize("mix", [1, 2])
def test_whole_lanes_in_threaded_pieces_is_the_definition(mix, monkeypatch):
    # a compare's parent hashes a big record in pieces on several threads: the lanes of the pieces,
    # each hashed at its own offset, add up to the whole tensor's (exact integers, any order)
    from tpdiag.kernels.record_hash_ref import M32, _pieces, whole_lanes

    monkeypatch.setenv("TPDIAG_HASH_THREADS", "3")
    for t in _tensors():
        n = t.numel() * (2 if t.is_complex() else 1)
        assert len(_pieces(n, 7)) == 3  # 7-word chunks: three pieces, the last one short
        want = tuple(x & M32 for x in reference_lanes(t, mix))
        assert whole_lanes(t, mix, chunk=7) == want, t.dtype
        # negative control: a piece hashed at offset 0 instead of its own is another hash
        import tpdiag.kernels.record_hash_ref as ref

        real = ref._lanes_numpy
        monkeypatch.setattr(ref, "_lanes_numpy", lambda v, sn, fb, ob, one, m, c: real(v, sn, fb, 0, one, m, c))
        assert whole_lanes(t, mix, chunk=7) != want, t.dtype
        monkeypatch.setattr(ref, "_lanes_numpy", real)
