"""A user's own Megatron-style sequence-parallel TP step (helper htrial12): the residual stream
stays each rank's sequence shard as a plain tensor between DTensor-planned linears, so the RMSNorms
on it are plain modules with plain replicated weights - each rank's weight grad covers its own
tokens only, and the loop all-reduces those grads after the backward (Megatron's
finalize_model_grads does the same for its sequence-parallel layernorms). Own AdamW, loss_parallel.

  none          the norm weights' grads all-reduced over the TP group after the backward
  no_allreduce  that all-reduce forgotten: each rank steps its norm weights from its own half

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_sp_norm.py --out DIR --bug no_allreduce
    tpdiag diff DIR_TP1 DIR_TP2
tests/test_user_sp_norm.py runs it (gloo worlds) and diffs the captures.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, SEQ, SEED = 32, 16, 32, 8, 11


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class SeqLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.mlp = Block()
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(self.mlp_norm(h))
        return self.head(self.norm(h))


def plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    # the norms are in no entry: they run on the plain local sequence shard
    return {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def step(out: str, bug: str = "none") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    world = dist.get_world_size()
    tpdiag.set_deterministic(seed=SEED, cpu_threads=1)
    model, pl = SeqLM(), plan()
    mesh = None
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, pl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    with tpdiag.capture(model, out=out, plan=pl, seed=SEED, group=mesh) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        with loss_parallel() if world > 1 else nullcontext():
            loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
            cap.loss(loss)
            loss.backward()
        if world > 1 and bug != "no_allreduce":
            for n, p in model.named_parameters():
                if "norm" in n:  # plain replicated weights, each rank's tokens only
                    dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        cap.params()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", default="none", choices=("none", "no_allreduce"))
    a = ap.parse_args()
    dist.init_process_group("gloo")
    step(a.out, a.bug)
    dist.destroy_process_group()
