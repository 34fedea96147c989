"""A user's capture script whose grad hook their own parallelize_module drops (helper hstep16).

    torchrun --standalone --nproc-per-node 1 tests/models/planted/capture_hook.py --out cap-tp1
    torchrun --standalone --nproc-per-node 2 tests/models/planted/capture_hook.py --out cap-tp2
    tpdiag diff cap-tp1 cap-tp2

`halve` (g / 2) on the down projection's weight, registered where most scripts set up their model:
before the plan (--when before). At TP=1 no plan runs and the hook halves the grad; at TP=2
parallelize_module puts a new DTensor Parameter in the weight's place, without the hook - tpdiag
never saw the model before the plan, so only the two captures' hooks tell it (world.json
param_hooks / dtensor_params). --when after registers it on the parameter the plan left: kept.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import tpdiag

DIM, FF = 16, 32


def halve(g):
    return g / 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, FF, bias=False)
        self.down = nn.Linear(FF, DIM, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--when", choices=("before", "after"), default="before")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tpdiag.set_deterministic(seed=7, cpu_threads=1)
    model = MLP()
    plan = {"up": "colwise", "down": "rowwise"}
    if args.when == "before":
        model.down.weight.register_hook(halve)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if args.when == "after":
        model.down.weight.register_hook(halve)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(8))
    with tpdiag.capture(model, out=args.out, plan=plan, seed=7, group=mesh) as cap:
        cap.batch(x=x)
        loss = model(x).square().mean()
        cap.loss(loss)
        loss.backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
