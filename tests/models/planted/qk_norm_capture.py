"""The QK-norm over the local columns (qk_norm_local.py) captured in the user's own loop - a case
for the verdict's owners (helper hnew14, 2026-11-30), not a test:

    torchrun --standalone --nproc-per-node 1 tests/models/planted/qk_norm_capture.py /tmp/q1
    torchrun --standalone --nproc-per-node 2 tests/models/planted/qk_norm_capture.py /tmp/q2
    tpdiag diff /tmp/q1 /tmp/q2

This file's run (the norm inline in Attention.forward): `divergent, not judged (cause unknown)` at
`forward: attention.wo (in 0), computed in attention's own forward code`, max abs 1.32e-01, ULP
2.06e9, `tpdiag gate` exit 1 - where `tpdiag compare --model
py:tests/models/planted/qk_norm_local.py:qk_local --tp 1,2` reads BUG (sharding-bug at the norm's
aten::mul, ~2e5x beyond rounding, gate 4). My torchtitan-style model with the norm in a submodule
of its own read the same in a capture at that module: `unknown` ("more than another code path of
one elementwise kernel explains (it may reduce over a sharded dimension ...)"), gate 1. A capture
re-executes nothing in float64, so no bound judges these records: a wrong result reads as "not
judged" rather than BUG. `--ok` (per-head norm) is the control.

Now (helper hred15): `--oracle` captures with `tpdiag.capture(..., oracle=["attention"])`, whose
float64 re-execution of the attention judges it: BUG (sharding-bug, ~5e4x beyond rounding), gate 4;
without it the gate exits 2 naming that call (tests/test_capture_oracle.py). `--all` writes the
three captures that test reads into OUT/bug, OUT/bug-oracle and OUT/ok-oracle, one process start.
"""
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

import tpdiag
from qk_norm_local import LM, VOCAB, plan


def step(out: str, per_head: bool, oracle, world: int) -> None:
    """One training step of the user's loop, captured into `out`, from a fresh model and seed."""
    tpdiag.set_deterministic(seed=7, cpu_threads=1)
    model, p = LM(per_head=per_head), plan()
    mesh = None
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    with tpdiag.capture(model, out=out, plan=p, seed=7, group=mesh, oracle=oracle) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        with loss_parallel() if world > 1 else nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            cap.loss(loss)
            loss.backward()
        opt.step()
        opt.zero_grad()
        cap.params()


if __name__ == "__main__":
    out = sys.argv[1]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if "--all" in sys.argv:
        for sub, per_head, oracle in (("bug", False, None), ("bug-oracle", False, ["attention"]),
                                      ("ok-oracle", True, ["attention"])):
            step(os.path.join(out, sub), per_head, oracle, world)
    else:
        step(out, "--ok" in sys.argv, ["attention"] if "--oracle" in sys.argv else None, world)
    dist.destroy_process_group()
