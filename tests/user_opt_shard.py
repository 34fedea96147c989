"""A user's own TP training step with a hand-written AdamW (DTensor plan), captured with
`tpdiag.capture` over two steps, with optimizer-side mistakes that only a sharded run makes (--bug):

  none            the step as TP=1 takes it: every rank updates its shard of every param
  lr_local_shape  Muon-style lr scaling, lr * sqrt(max(1, rows / cols)), computed from the
                  LOCAL shard's shape (`p.to_local().shape`): a column shard has rows / TP rows, so
                  the sharded matrices move by another lr at TP > 1 (the replicated ones do not)
  lr_world        the linear scaling rule, lr * dist.get_world_size(): the TP ranks counted as
                  data-parallel replicas, every update TP times the reference's

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_opt_shard.py --out DIR --bug lr_local_shape
    tpdiag diff DIR_TP1 DIR_TP2
"""
from __future__ import annotations

import argparse
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 32, 32, 64


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel(),
            "head": ColwiseParallel(use_local_output=False)}


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class HandAdamW:
    """AdamW on each param's local tensor (as a user's fused optimizer does)."""

    def __init__(self, params, lr=1e-2, wd=0.1, bug="none"):
        self.params, self.lr, self.wd, self.bug = list(params), lr, wd, bug
        self.state = {}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            w, g = local(p), local(p.grad)
            st = self.state.setdefault(id(p), {"t": 0, "m": torch.zeros_like(w), "v": torch.zeros_like(w)})
            st["t"] += 1
            st["m"].mul_(0.9).add_(g, alpha=0.1)
            st["v"].mul_(0.999).addcmul_(g, g, value=0.001)
            mhat = st["m"] / (1 - 0.9 ** st["t"])
            vhat = st["v"] / (1 - 0.999 ** st["t"])
            lr = self.lr
            if w.dim() == 2:
                # Muon-style shape scaling; the mistake reads the local shard's shape
                rows, cols = (w.shape if self.bug == "lr_local_shape" else p.shape)
                lr = lr * math.sqrt(max(1.0, rows / cols))
            w.mul_(1 - lr * self.wd)
            w.add_(mhat / (vhat.sqrt() + 1e-8), alpha=-lr)


BUGS = ("none", "lr_local_shape", "lr_world")


def steps(out: str, bug: str) -> None:
    """Two training steps of the user's loop, captured to `out` (the process group is up)."""
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = TinyLM()
    plan = tp_plan()
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)
    lr = 1e-2 * (tp if bug == "lr_world" else 1)  # the mistake: TP ranks are no DP replicas
    opt = HandAdamW(model.parameters(), lr=lr, bug=bug)
    g = torch.Generator().manual_seed(1)
    loss_ctx = nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as loss_ctx

    with tpdiag.capture(model, out=out, plan=plan, seed=0) as cap:
        for step in range(2):
            if step:
                cap.next_step()
            ids = torch.randint(0, VOCAB, (2, 8), generator=g)
            labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
            cap.batch(input_ids=ids, labels=labels)
            logits = model(ids)
            with loss_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                cap.loss(loss)
                loss.backward()
            opt.step()
            for p in model.parameters():
                p.grad = None
            cap.params()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", default="none", choices=BUGS)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    steps(args.out, args.bug)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
