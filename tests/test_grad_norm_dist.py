"""invariant-grad-norm's bucketed exchange in real 2- and 4-rank gloo worlds: every sharded grad
comes back whole and bit-exact on exactly one rank, its owner (Shard(0), Shard(1), uneven ->
full_tensor everywhere, replicated, and a packed gate/up _StridedShard(1, sf=2) put together
without DTensor's redistribute, which torch 2.11 refuses for it), across bucket boundaries, and
the norm - the owners' norms shared - is the same bits as on one process holding the whole
grads. A 384 x 512 grad makes the order of its float64 sum show in the last bits: the norm taken
shard by shard (each rank's sum of squares, combined) is other bits; so is the stock norm (the
grads' float32). A transposed grad's norm is its logical order's (its contiguous copy's)."""
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from conftest import gloo_world


def _wholes():
    gen = torch.Generator().manual_seed(0)
    # mixed magnitudes, so that the order of a float64 sum of squares shows in its last bits
    shapes = [(8, 6), (6, 10), (4, 8), (5, 3), (7,), (3, 8, 5), (384, 512)]
    out = [torch.randn(*sh, generator=gen) * 10.0 ** torch.randint(-4, 5, sh, generator=gen) for sh in shapes]
    out[1] = out[1].bfloat16()
    return out


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
              _StridedShard(1, split_factor=2),  # [E, 2I, H] packed gate/up
              Shard(1)]
    grads = [distribute_tensor(w, mesh, [p]) for w, p in zip(wholes, places)]
    full = DTensor.full_tensor

    def refuse_strided(self, *a, **k):  # what torch 2.11 does for a lone sf=2 _StridedShard
        if any(type(p).__name__ == "_StridedShard" for p in self.placements):
            raise ValueError("use_strided_shard_as_shard_order is True, but placements ...")
        return full(self, *a, **k)

    DTensor.full_tensor = refuse_strided
    res = []
    # several buckets (one grad larger than a bucket), then every grad in one (an owner's grads
    # side by side in one exchange)
    for bucket_bytes in (100, 1 << 20):
        gn.BUCKET_BYTES = bucket_bytes
        sharded: dict = {}
        got = dict(gn._owned_wholes(grads, sharded))
        exact = {i: torch.equal(got[i].view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32),
                                w.view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32))
                 for i, w in enumerate(wholes) if i in got}
        owned = [None] * world
        dist.all_gather_object(owned, exact)  # every rank's check of the wholes it holds
        norm = gn.grad_norm([SimpleNamespace(grad=g) for g in grads])
        res.append({"owned": owned, "sharded": [sorted(v[1]) for v in sharded.values()],
                    "norm": norm.item()})
    # clipping: on the device, each rank's shards scaled by torch's coefficient from the norm
    # (the whole grads scaled by it on one process give the same bits)
    before = [g.to_local().clone() for g in grads]
    total = gn.grad_norm_and_clip([SimpleNamespace(grad=g) for g in grads], norm.item() / 3)
    coef = torch.clamp(norm.item() / 3 / (total.to(gn.norm_dtype(before)) + 1e-6), max=1.0)
    clipped = all(torch.equal(g.to_local(), b * coef) and not torch.equal(g.to_local(), b)
                  for g, b in zip(grads, before))
    # a TP-dependent order: each rank's float64 sum of squares of its shard, summed over ranks
    # (replicated grads counted once)
    sq = torch.stack([g.to_local().double().pow(2).sum() / (1 if g.placements[0].is_shard() or
                      type(g.placements[0]).__name__ == "_StridedShard" else world) for g in grads])
    dist.all_reduce(sq)
    by_shard = torch.linalg.vector_norm(sq.sqrt())
    # the stock way (torch's clip_grad_norm_ on DTensors): the same in the grads' float32
    sq32 = torch.stack([g.to_local().float().pow(2).sum() / (1 if g.placements[0].is_shard() or
                        type(g.placements[0]).__name__ == "_StridedShard" else world) for g in grads]).sum()
    dist.all_reduce(sq32)
    if rank == 0:
        q.put({"runs": res, "by_shard": by_shard.item(), "stock": sq32.sqrt().item(), "clipped": clipped})
    dist.barrier()
    dist.destroy_process_group()


def _f64(x):
    return torch.tensor(x, dtype=torch.float64).view(torch.int64)


def test_owners_put_each_grad_together_and_norm_matches_one_process():
    from tpdiag.kernels import grad_norm as gn

    one = gn.grad_norm([SimpleNamespace(grad=w) for w in _wholes()])
    for world in (2, 4):
        got = gloo_world(_worker, world, timeout=120)
        for r in got["runs"]:
            sharded = r["sharded"][0]
            assert sharded, "no grad took the owners' exchange"
            # every sharded grad whole and exact on exactly one rank; every other on every rank
            for i in range(len(_wholes())):
                holders = [o[i] for o in r["owned"] if i in o]
                assert len(holders) == (1 if i in sharded else world) and all(holders), (world, i, r["owned"])
            assert _f64(r["norm"]) == one.view(torch.int64), world
        assert got["clipped"], world
        assert _f64(got["by_shard"]) != one.view(torch.int64), world
        assert _f64(got["stock"]) != one.view(torch.int64), world


def test_a_transposed_grad_is_reduced_in_its_logical_order():
    from tpdiag.kernels import grad_norm as gn

    big = _wholes()[-1]
    t = big.t()  # a parameter stored transposed: its grad is a non-contiguous view
    norm = gn.grad_norm([SimpleNamespace(grad=t)])
    assert norm.view(torch.int64) == gn.grad_norm([SimpleNamespace(grad=t.contiguous())]).view(torch.int64)
    # negative control: the reduction of the view itself runs in memory order - other bits
    assert torch.linalg.vector_norm(t, dtype=torch.float64).view(torch.int64) != norm.view(torch.int64)
