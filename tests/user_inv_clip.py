"""A user's own TP step under `tpdiag.invariant` recorded with `tpdiag.capture` (helper htrial12):
DTensor plan, loss_parallel, own AdamW, and the clip the user already had - torch's own
`clip_grad_norm_` (--clip torch), which the switch does not reach, or `tpdiag.clip_grad_norm_`
(--clip tpdiag), as docs/training.md says to call.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_inv_clip.py --out DIR --clip torch
    tpdiag diff DIR_TP1 DIR_TP2
tests/test_user_inv_clip.py runs it (gloo worlds) and diffs the captures.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

# torch's clip differs from TP=1 only by where its norm rounds (the grads are bitwise): whether the
# last bit moves is the host's. Seed 5 differed on the AMD EPYC hosts and read bitwise on an
# AVX-512/AMX Xeon, where 7 differs: USER_SEED picks one (the test tries them in turn)
VOCAB, DIM, HIDDEN, SEQ, SEED = 128, 64, 256, 16, 7


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.silu(self.up(h)))
        return self.head(h)


def plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"embed": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(), "down": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def step(out: str, clip: str = "tpdiag") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    import os

    world, seed = dist.get_world_size(), int(os.environ.get("USER_SEED", SEED))
    tpdiag.set_deterministic(seed=seed, cpu_threads=1)
    model, pl = TinyLM(), plan()
    mesh = None
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, pl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    clip_fn = tpdiag.clip_grad_norm_ if clip == "tpdiag" else torch.nn.utils.clip_grad_norm_
    with tpdiag.invariant(model, pl, fixes="all", tree_groups=2), \
            tpdiag.capture(model, out=out, plan=pl, seed=seed, group=mesh) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        with loss_parallel() if world > 1 else nullcontext():
            loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
            cap.loss(loss)
            loss.backward()
        gn = clip_fn(model.parameters(), 0.5)
        cap.grad_norm(gn.full_tensor() if isinstance(gn, DTensor) else gn)
        opt.step()
        opt.zero_grad()
        cap.params()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--clip", default="tpdiag", choices=("torch", "tpdiag"))
    a = ap.parse_args()
    dist.init_process_group("gloo")
    step(a.out, a.clip)
    dist.destroy_process_group()
