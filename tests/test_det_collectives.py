"""deterministic-collectives in a real 4-rank gloo world: the functional all-reduce becomes a
rank-ordered sum while the fix is on, and the stock kernel is back after it."""
import os

import torch
import torch.distributed as dist

from conftest import gloo_world


def _worker(rank, world, port, q):
    import torch.distributed._functional_collectives as funcol

    from tpdiag.kernels.det_collectives import deterministic_all_reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4096, generator=g) * 10 ** torch.randn(4096, generator=g)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    ordered = parts[0].clone()
    for p in parts[1:]:
        ordered = ordered + p

    def reduce(t, op="sum"):
        y = funcol.all_reduce(t, op, dist.group.WORLD)
        return y.wait() if hasattr(y, "wait") else torch.as_tensor(y)

    stock_before = reduce(x)
    with deterministic_all_reduce():
        det = reduce(x)
        det_max = reduce(x, "max")
    stock_after = reduce(x)
    if rank == 0:
        q.put({"det_is_ordered": torch.equal(det.view(torch.int32), ordered.view(torch.int32)),
               "max_ok": torch.equal(det_max, torch.stack(parts).amax(0)),
               "stock_restored": torch.equal(stock_after.view(torch.int32), stock_before.view(torch.int32)),
               "stock_is_ordered": torch.equal(stock_before.view(torch.int32), ordered.view(torch.int32))})
    dist.barrier()
    dist.destroy_process_group()


def test_rank_ordered_all_reduce_and_restore():
    r = gloo_world(_worker, 4)
    assert r["det_is_ordered"] and r["max_ok"] and r["stock_restored"]
    # negative control: gloo's own all-reduce adds in another order on this data
    assert not r["stock_is_ordered"]
