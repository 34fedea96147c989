"""A user's own TP training step (DTensor plan, own clipping, own AdamW) captured with
`tpdiag.capture`, with the optimizer-side mistakes people make (--bug):

  none        the global norm: every grad's whole norm (DTensor.full_tensor of its local norm)
  clip_local  the norm of this rank's LOCAL shards only (`to_local()`): each rank clips with
              its own scale - the sharded params move by other amounts than at TP=1, and the
              replicated embedding by another amount on each rank
  clip_count  the sum of squares all-reduced over the ranks for every grad, the replicated
              embedding's too: its grad counted TP times in the total norm
  rep_rank0   the replicated embedding stepped on rank 0 only (the others leave it out of the
              optimizer, as if rank 0 owned it, and never broadcast it)

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_tp_clip.py --out DIR --bug clip_local
    tpdiag diff DIR_TP1 DIR_TP2

Run by hand at TP=1 and TP=2 for docs/planted.md's table (every mistake reads BUG, gate 4; `none`
rounding only, gate 1). Not run by the suite: tpdiag already named each one, and four torchrun
launches per case would cost CI ~2 minutes.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 32, 32, 64
MAX_NORM = 0.05  # small enough that every variant clips


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


def grad_norm(params, bug: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if bug == "clip_local":
        sq = [torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g) ** 2 for g in grads]
        return torch.stack(sq).sum().sqrt()
    if bug == "clip_count":
        sq = torch.stack([torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g) ** 2
                          for g in grads]).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(sq)
        return sq.sqrt()
    norms = [torch.linalg.vector_norm(g) for g in grads]
    return torch.linalg.vector_norm(torch.stack(
        [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", default="none", choices=("none", "clip_local", "clip_count", "rep_rank0"))
    args = ap.parse_args()

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = TinyLM()  # the whole model, the same weights on every rank, then sharded
    plan = tp_plan()
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)
    params = list(model.parameters())
    if args.bug == "rep_rank0" and dist.get_rank() > 0:
        params = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        loss_ctx = loss_parallel()
    else:
        loss_ctx = nullcontext()

    with tpdiag.capture(model, out=args.out, plan=plan, seed=0) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        with loss_ctx:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            cap.loss(loss)
            loss.backward()
        total = grad_norm(model.parameters(), args.bug)
        cap.grad_norm(total)
        coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.params()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
