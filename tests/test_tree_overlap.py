"""The tree all-reduce in row chunks (kernels/tree_overlap.py), in real gloo worlds: each chunk's
collective issued asynchronously, the rounded chunks all-gathered - the same bits as the whole
tree at 2 ranks (reduce-scatter) and 4 (all-to-all), for chunks that do not divide by the world;
and a fixed model's forward and backward (every fix on, TP=2) bitwise with and without it, the
chunked path taken. Negative control: each chunk's partial rounded to bf16 before its collective
(what a naive overlap of stock's bf16 all-reduce would do) is other bits."""
import os

import torch
import torch.distributed as dist

from conftest import gloo_world

FIXES = ("tp-invariant-linear", "invariant-gemm", "invariant-vocab-softmax", "invariant-grad-norm",
         "invariant-attention")
ROWS, N = 37, 7  # 259 elements; chunks of 13 rows = 91 elements: padded at 2 and 4 ranks


def _parts(world):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(ROWS, N, generator=gen) * 10.0 ** torch.randint(-3, 4, (ROWS, N), generator=gen)
            for _ in range(world)]


def _bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape)


def _unit_worker(rank, world, port, q):
    from tpdiag.kernels import tree_overlap
    from tpdiag.kernels.tree import tree_reduce_scattered

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    part = _parts(world)[rank]
    tree_overlap.ON[0], tree_overlap.CHUNKS[0], tree_overlap.MIN_ROWS = True, 3, 1
    assert tree_overlap.usable(ROWS)
    cpu = torch.device("cpu")
    got = [tree_overlap.reduce_in_chunks(lambda r0, r1: part[r0:r1], ROWS, N, dt, cpu)
           for dt in (torch.float32, torch.bfloat16)]
    whole = [tree_reduce_scattered(part, dt) for dt in (torch.float32, torch.bfloat16)]
    naive = tree_overlap.reduce_in_chunks(lambda r0, r1: part[r0:r1].to(torch.bfloat16).float(), ROWS, N,
                                          torch.bfloat16, cpu)
    if rank == 0:
        q.put([_bytes(t) for t in got + whole + [naive]])
    dist.barrier()
    dist.destroy_process_group()


def _load(items):
    return [torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dt).view(shape) for b, dt, shape in items]


def test_chunked_tree_is_the_whole_tree_at_2_and_4_ranks():
    from tpdiag.kernels.tree import tree_sum_stacked

    for world in (2, 4):
        got32, got16, whole32, whole16, naive = _load(gloo_world(_unit_worker, world, timeout=120))
        ref = tree_sum_stacked(torch.stack(_parts(world)))
        assert torch.equal(got32.view(torch.int32), ref.view(torch.int32)), world
        assert torch.equal(got32.view(torch.int32), whole32.view(torch.int32)), world
        assert torch.equal(got16.view(torch.int16), whole16.view(torch.int16)), world
        assert not torch.equal(naive.view(torch.int16), got16.view(torch.int16)), world


def _model_worker(rank, world, port, q):
    from tpdiag.config import WorldConfig
    from tpdiag.fixes.registry import apply_fixes
    from tpdiag.kernels import tree_overlap
    from tpdiag.runner import determinism
    from tpdiag.runner.logits import whole_vocab
    from tpdiag.runner.batch import forward_call, make_batch
    from tpdiag.runner.build import build_model
    from tpdiag.runner.logits import logits_of
    from tpdiag.runner.losses import loss_context, step_functions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    determinism.setup(0, "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = WorldConfig.of(model="tiny-llama", degree=world, label=str(world), out_dir="/tmp/x",
                         batch_size=2, seq_len=16)
    target, model = build_model(cfg, torch.device("cpu"), world)
    batch, labels = make_batch(cfg, target, torch.device("cpu"))
    fargs, fkwargs = forward_call(model, batch)
    calls = [0]
    chunked = tree_overlap.reduce_in_chunks

    def counted(*a, **k):
        calls[0] += 1
        return chunked(*a, **k)

    tree_overlap.reduce_in_chunks = counted
    out = []
    for on in (False, True):
        tree_overlap.ON[0], tree_overlap.CHUNKS[0], tree_overlap.MIN_ROWS = on, 3, 1
        model.zero_grad(set_to_none=True)
        with apply_fixes(FIXES, model=model, plan=target.plan, world=world):
            loss_fn, _, _ = step_functions(target)
            local = logits_of(model(*fargs, **fkwargs))
            logits, _ = whole_vocab(local, model, target.plan, target.vocab_size, world)
            with loss_context(world):
                loss = loss_fn(local if target.loss is not None else logits, labels)
                loss.backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for p in model.parameters()]
        out.append([loss.detach()] + grads)
        if not on:
            off_calls = calls[0]
    if rank == 0:
        q.put({"off_calls": off_calls, "on_calls": calls[0] - off_calls,
               "runs": [[_bytes(t) for t in r] for r in out]})
    dist.barrier()
    dist.destroy_process_group()


def test_fixed_model_is_bitwise_with_the_chunked_collectives():
    got = gloo_world(_model_worker, 2, timeout=180)
    assert got["off_calls"] == 0 and got["on_calls"] > 0, got["on_calls"]
    off, on = (_load(r) for r in got["runs"])
    assert len(off) == len(on) > 2
    for a, b in zip(off, on):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
