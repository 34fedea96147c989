"""The smallest capture job a user writes: torchrun, gloo, a two-Linear model sharded with a
plan, one step inside `tpdiag.capture`. tests/test_capture_exit.py runs it repeatedly and
requires exit code 0 from every rank every time.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_capture_exit.py --out DIR [--no-destroy]

--no-destroy: the script ends without dist.destroy_process_group() (many scripts do).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import tpdiag


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-destroy", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    plan = {"0": "colwise", "2": "rowwise"}
    if dist.get_world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with tpdiag.capture(model, out=args.out, plan=plan, seed=0) as cap:
        cap.batch(x=x)
        loss = model(x).square().mean()
        cap.loss(loss)
        loss.backward()
    if not args.no_destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
