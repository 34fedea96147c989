"""The cross-rank tree step (fixed-order reduce-scatter + tree + one rounding + all-gather) in a
real 4-rank gloo world: every element is the same bits as the whole tree summed in one process
(tree_sum_stacked over every rank's partial), for an element count that does not divide by the
world, fp32 and a bf16 result. Negative control: the stock all-reduce of the same partials, in
the same world, is not that tree's bits."""
import os

import torch
import torch.distributed as dist

from conftest import gloo_world

SHAPE = (7, 37)  # 259 elements: not a multiple of 4, so the scatter pads


def _parts(world):
    gen = torch.Generator().manual_seed(1)
    # mixed magnitudes so the sum order shows in the last bits
    return [torch.randn(*SHAPE, generator=gen) * 10.0 ** torch.randint(-3, 4, SHAPE, generator=gen)
            for _ in range(world)]


def _worker(rank, world, port, q):
    from tpdiag.kernels.tree import tree_all_reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    part = _parts(world)[rank].clone().requires_grad_(True)
    y32 = tree_all_reduce(part)
    y16 = tree_all_reduce(part, torch.bfloat16)
    y16.float().sum().backward()  # the grad passes through, upcast to the partial's dtype
    stock = part.detach().clone()
    dist.all_reduce(stock)
    if rank == 0:
        # raw bytes: tensors sent through the queue would live in this process's shared memory
        q.put(tuple((t.detach().view(-1).view(torch.uint8).numpy().tobytes(), t.dtype)
                    for t in (y32, y16, part.grad, stock)))
    dist.barrier()
    dist.destroy_process_group()


def _run(world):
    from tpdiag.kernels.tree import tree_sum_stacked

    out = tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dt).view(SHAPE)
                for b, dt in gloo_world(_worker, world, timeout=120))
    return out, tree_sum_stacked(torch.stack(_parts(world)))


def test_tree_all_reduce_two_ranks_is_the_tree():
    """Two ranks take a reduce-scatter (one fp32 add, which commutes) instead of the all-to-all."""
    (y32, y16, grad, _), whole = _run(2)
    assert torch.equal(y32.view(torch.int32), whole.view(torch.int32))
    assert torch.equal(y16.view(torch.int16), whole.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(grad, torch.ones(SHAPE))
    # negative control: partials rounded to bf16 before the sum (a stock bf16 all-reduce) differ
    p0, p1 = (p.to(torch.bfloat16) for p in _parts(2))
    assert not torch.equal((p0 + p1).view(torch.int16), y16.view(torch.int16))


def test_tree_all_reduce_is_the_whole_tree():
    (y32, y16, grad, stock), whole = _run(4)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert torch.equal(y32.view(torch.int32), whole.view(torch.int32))
    assert torch.equal(y16.view(torch.int16), whole.to(torch.bfloat16).view(torch.int16))
    assert grad.dtype == torch.float32 and torch.equal(grad, torch.ones(SHAPE))
    # negative control: gloo's own all-reduce adds in another order
    assert not torch.equal(stock.view(torch.int32), whole.view(torch.int32))
