"""A user's own grad-norm clipping in a tensor-parallel training loop, captured with
`tpdiag.capture` (helper hplant17). The MLP is split by a DTensor plan (up `ColwiseParallel`, down
`RowwiseParallel`: sharded weights, down's bias a Replicate DTensor); the embedding, the norm and
the head stay plain tensors, replicated on every rank. The user clips to MAX_NORM by hand, as
Megatron's `clip_grad_norm_fp32` does: each rank sums the squares of its grads' local values and the
ranks all-reduce the sum.
    torchrun --standalone --nproc-per-node 1 tests/models/planted/clip_norm.py --out cap-tp1
    torchrun --standalone --nproc-per-node 2 tests/models/planted/clip_norm.py --out cap-tp2 --clip all
    tpdiag diff cap-tp1 cap-tp2
  --clip all     the mistake: the squares of EVERY grad all-reduced - a replicated grad is whole on
                 every rank, so it is counted TP times: the norm too large, every grad clipped too
                 hard (the step's grads and the forward right; the update wrong)
  --clip local   the other mistake: the sharded grads' squares never all-reduced - each rank clips
                 by the norm of its own shards, so the ranks scale their replicated grads apart
  --clip shards  the twin: the sharded grads' local squares all-reduced, each replicated grad
                 counted once (Megatron counts a replicated parameter on one rank only)
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 16, 32, 2, 8
MAX_NORM = 0.5  # below the step's grad norm: the clip acts


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, FF)
        self.down = nn.Linear(FF, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(h))


def clip_grads(params, max_norm, how):
    from torch.distributed.tensor import DTensor

    sharded = torch.zeros((), dtype=torch.float32)
    whole = torch.zeros((), dtype=torch.float32)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            local = g.to_local()
            if how == "all" or any(pl.is_shard() for pl in g.placements):
                sharded += local.float().pow(2).sum()
            else:
                whole += local.float().pow(2).sum()
        elif how == "all":
            sharded += g.float().pow(2).sum()
        else:
            whole += g.float().pow(2).sum()
    if dist.get_world_size() > 1 and how != "local":
        dist.all_reduce(sharded)
    norm = (sharded + whole).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return norm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--clip", choices=("all", "local", "shards"), default="shards")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tpdiag.set_deterministic(seed=11, cpu_threads=1)
    model = Net()
    plan = {"up": "colwise", "down": "rowwise"}
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    with tpdiag.capture(model, out=args.out, plan=plan, seed=11, group=mesh) as cap:
        for step in range(2):
            if step:
                cap.next_step()
            cap.batch(input_ids=ids, labels=labels)
            logits = model(ids)
            cap.logits(logits)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            cap.loss(loss)
            loss.backward()
            cap.grad_norm(clip_grads(params, MAX_NORM, args.clip))
            opt.step()
            opt.zero_grad()
            cap.params()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
