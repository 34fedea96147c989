"""invariant-grad-norm's bucketed gather in a real 2-rank gloo world: every sharded grad comes
back whole and bit-exact (Shard(0), Shard(1), uneven -> full_tensor, replicated, and a packed
gate/up _StridedShard(1, sf=2) gathered without DTensor's redistribute, which torch 2.11 refuses for
it), across bucket boundaries, and the norm is the same bits as on one process holding the whole
grads."""
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from conftest import gloo_world


def _wholes():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=gen), torch.randn(6, 10, generator=gen).bfloat16(),
            torch.randn(4, 8, generator=gen), torch.randn(5, 3, generator=gen),
            torch.randn(7, generator=gen), torch.randn(3, 8, 5, generator=gen)]


def _worker(rank, world, port, q):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from tpdiag.kernels import grad_norm as gn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    wholes = _wholes()
    places = [Shard(0), Shard(1), Shard(1), Shard(0), Replicate(),  # (5, 3) on dim 0: uneven
              _StridedShard(1, split_factor=2)]  # [E, 2I, H] packed gate/up
    grads = [distribute_tensor(w, mesh, [p]) for w, p in zip(wholes, places)]
    full = DTensor.full_tensor

    def refuse_strided(self, *a, **k):  # what torch 2.11 does for a lone sf=2 _StridedShard
        if any(type(p).__name__ == "_StridedShard" for p in self.placements):
            raise ValueError("use_strided_shard_as_shard_order is True, but placements ...")
        return full(self, *a, **k)

    DTensor.full_tensor = refuse_strided
    gn.BUCKET_BYTES = 100   # several buckets, one grad larger than a bucket
    got = dict(gn.whole_grads(grads))
    exact = [torch.equal(got[i].view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32),
                         w.view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32))
             for i, w in enumerate(wholes)]
    norm = gn.grad_norm([SimpleNamespace(grad=g) for g in grads])
    if rank == 0:
        q.put({"exact": exact, "norm": norm.item()})
    dist.barrier()
    dist.destroy_process_group()


def test_bucketed_gather_is_exact_and_norm_matches_one_process():
    from tpdiag.kernels import grad_norm as gn

    r = gloo_world(_worker, 2)
    assert all(r["exact"]), r["exact"]
    one = gn.grad_norm([SimpleNamespace(grad=w) for w in _wholes()])
    assert torch.tensor(r["norm"], dtype=torch.float64).view(torch.int64) == one.view(torch.int64)
