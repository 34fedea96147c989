"""The gather's stored hash of a stacked record is made from lanes each rank computes on its own
shard at offset rank * numel (runner/gather_hash.py), with no host pass over the stack: it must
equal the host hash of the stacked tensor bit for bit - for every dtype, for records split over
gather windows at odd places, streamed to the host store or not."""
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from conftest import ROOT, gloo_world


def _records(rank: int):
    from tpdiag.records.hashing import tensor_hash

    g = torch.Generator().manual_seed(0)
    recs = []

    def add(key, t, hashed=True):
        m = {"key": key, "idx": len(recs), "dtype": str(t.dtype).replace("torch.", ""),
             "local_shape": list(t.shape), "_hash_is_tensor": hashed}
        if hashed:
            m["hash"] = tensor_hash(t)
        recs.append((m, t))

    add("f32", torch.randn(33, 7, generator=g) + rank)
    add("bf16", (torch.randn(5, 301, generator=g) * (1 + rank)).to(torch.bfloat16))
    add("i64", torch.arange(37, dtype=torch.int64) * (rank + 3))
    bits = torch.rand(13, generator=g) > 0.5
    add("bool", bits if rank == 0 else torch.ones(13, dtype=torch.bool))
    add("f16", (torch.randn(3, 3, generator=g) - rank).to(torch.float16), hashed=False)  # decided by bytes
    add("equal", torch.randn(11, generator=g), hashed=False)  # the same on both: stored once
    add("empty", torch.zeros(0, 4) + rank)
    return recs


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tpdiag.probes.stream import as_tensor
    from tpdiag.runner import gather_hash
    from tpdiag.runner.gather import gather_records

    out = {}
    real = gather_hash.StackLanes.offset
    for wrong in (False, True):
        if wrong:  # the negative control: each shard hashed at offset 0, as if it stood alone
            gather_hash.StackLanes.offset = lambda self, n, start, es: start // es
        for window in ("1000000", "100"):  # one window; windows of 100 bytes cutting records anywhere
            os.environ["TPDIAG_GATHER_WINDOW"] = window
            for stream in (False, True):
                got = gather_records(_records(rank), torch.device("cpu"), stream=stream)
                if rank == 0:
                    out[(wrong, window, stream)] = [(m["key"], m["stored"], m["stored_hash"],
                                                     as_tensor(t).reshape(-1).view(torch.uint8).tolist(), str(as_tensor(t).dtype),
                                                     list(as_tensor(t).shape)) for m, t in got]
        gather_hash.StackLanes.offset = real
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def test_stored_hash_of_a_stack_is_the_host_hash():
    from tpdiag.records.hashing import tensor_hash

    res = gloo_world(_worker, 2, timeout=180)
    r0, r1 = _records(0), _records(1)
    for (wrong, window, stream), rows in res.items():
        stored = {}
        for key, how, h, raw, dtype, shape in rows:
            t = torch.tensor(raw, dtype=torch.uint8).view(getattr(torch, dtype.replace("torch.", ""))).reshape(shape)
            stored[key] = (how, h, t, tensor_hash(t))
        for i, (m, t0) in enumerate(r0):
            key, t1 = m["key"], r1[i][1]
            how, h, t, host = stored[key]
            want = torch.stack([t0, t1]) if how == "stacked" else t0
            # equal bytes (by bytes; the empty one by its hash): rank 0's alone
            assert how == ("single" if key in ("equal", "empty") else "stacked"), (key, how)
            assert t.shape == want.shape and t.dtype == want.dtype, key
            assert torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
            if wrong and how == "stacked" and t0.numel():
                # rank 1's shard hashed at the wrong place: another hash, which a read would refuse
                assert h != host, (key, window, stream)
            else:
                assert h == host, (key, window, stream, wrong)


def test_piece_lanes_at_offsets_sum_to_the_whole_triton():
    """The Triton kernel's lanes of 1-D pieces placed at element offsets (what a CUDA rank runs on
    its window) add up to the whole tensor's, under the interpreter: pieces that start at odd
    elements, bf16 (word pairs and not) and fp32."""
    code = r"""
import torch
from tpdiag.kernels import record_hash as rh
from tpdiag.kernels.record_hash_ref import whole_lanes
for dt in (torch.bfloat16, torch.float32):
    full = torch.randn(2 * 515).to(dt)
    n = full.numel()
    cuts = (0, 7, 515, 523, n)  # pieces that start at odd elements, as a window cuts them
    for pairs in (False, True) if dt == torch.bfloat16 else (False,):
        a = b = 0
        for s, e in zip(cuts, cuts[1:]):
            p = full[s:e].clone()
            ints, _ = rh.triton_lanes(p, *rh.slab(p.shape, 0, n, s), pairs=pairs)
            a, b = a + int(ints[0]), b + int(ints[1])
        assert (a & rh.M32, b & rh.M32) == whole_lanes(full), (dt, pairs)
    # the negative control: the second half hashed at offset 0, as if it stood alone
    first = rh.triton_lanes(full[:515].clone(), *rh.slab((515,), 0, n, 0))[0]
    wrong = rh.triton_lanes(full[515:].clone(), *rh.slab((n - 515,), 0, n, 0))[0]
    assert (int(first[0] + wrong[0]) & rh.M32, int(first[1] + wrong[1]) & rh.M32) != whole_lanes(full)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_piece_lanes_at_offsets_sum_to_the_whole_cuda():
    """The same on a GPU, through shard_lanes (what StackLanes calls): Triton's launch path for
    float32 / bfloat16, torch's for int64; pieces of a window at odd element offsets."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tpdiag.kernels.record_hash import M32, shard_lanes
    from tpdiag.kernels.record_hash_ref import whole_lanes

    g = torch.Generator().manual_seed(1)
    for full in (torch.randn(3 * 70001, generator=g), torch.randn(2 * 40000, generator=g).to(torch.bfloat16),
                 torch.arange(5001, dtype=torch.int64)):
        n = full.numel()
        cuts = (0, 7, n // 2, n // 2 + 9, n)
        a = b = 0
        for s, e in zip(cuts, cuts[1:]):
            ints, _ = shard_lanes(full[s:e].clone().cuda(), dim=0, full=n, offset=s, stats=False)
            a, b = a + int(ints[0]), b + int(ints[1])
        assert (a & M32, b & M32) == whole_lanes(full), full.dtype
