"""A user's own TP training step with gradient accumulation (DTensor plan, 4 micro-batches of one
sequence, own AdamW), recorded with `tpdiag.capture` (helper hbug7). --bug:

  none       each micro-batch's loss divided by the number of micro-batches, 4 at every degree
  accum_tp   the number of micro-batches computed as the global batch over (micro-batch size x
             WORLD size) - the data-parallel formula with the TP ranks taken for data-parallel
             ones: 4 at TP=1, 2 at TP=2; every micro-batch still runs (the loader yields the whole
             batch), so at TP=2 each loss, and every grad, is twice TP=1's

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_accum.py --out DIR --bug accum_tp
    tpdiag diff DIR_TP1 DIR_TP2
tests/test_user_accum.py runs it (gloo worlds) and diffs the captures.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, GLOBAL, MICRO, SEQ = 32, 32, 64, 4, 1, 8


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

    return {"up": ColwiseParallel(), "down": RowwiseParallel(), "head": ColwiseParallel(use_local_output=False)}


def grad_norm(params) -> torch.Tensor:
    """The global grad norm: every grad's whole norm (a DTensor's local norms combined)."""
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                 for n in norms]))


def step(out: str, bug: str) -> None:
    """One captured step on this rank (the process group is up)."""
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = TinyLM()
    plan = tp_plan()
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    # the mistake (accum_tp): a data-parallel world size that counts the TP ranks
    accum = GLOBAL // (MICRO * (tp if bug == "accum_tp" else 1))
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        loss_ctx = loss_parallel
    else:
        loss_ctx = nullcontext
    with tpdiag.capture(model, out=out, plan=plan, seed=0) as cap:
        cap.batch(input_ids=ids, labels=labels)
        for a in range(0, GLOBAL, MICRO):
            logits = model(ids[a:a + MICRO])
            with loss_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), labels[a:a + MICRO].flatten(), ignore_index=-100)
                (loss / accum).backward()
        cap.grad_norm(grad_norm(model.parameters()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.params()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", default="none", choices=("none", "accum_tp"))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    step(args.out, args.bug)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
