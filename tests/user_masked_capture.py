"""A user's own TP training step on a model whose padded vocabulary is masked to -inf in its forward
(tests/models/masked_vocab_llama.py), captured with `tpdiag.capture` (--bug):

  ok         the model's vocab-parallel cross-entropy
  loss_mean  the cross-entropy's exp sums averaged over the ranks where they must be added: the loss
             log(TP) low at TP > 1, its grads right

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_masked_capture.py --out DIR --bug loss_mean
    tpdiag diff DIR_TP1 DIR_TP2
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tpdiag
from models.masked_vocab_llama import BATCH, REAL, SEQ, PaddedLlama, plan, vocab_parallel_ce

BUGS = ("ok", "loss_mean")


def step(out: str, bug: str) -> None:
    """One training step of the user's loop, captured to `out` (the process group is up)."""
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = PaddedLlama()
    tp_plan = plan()
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), tp_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    with tpdiag.capture(model, out=out, plan=tp_plan, seed=0) as cap:
        ids = torch.randint(0, REAL, (BATCH, SEQ), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        cap.batch(input_ids=ids, labels=labels)
        loss = vocab_parallel_ce(model(ids), labels, mean_sum=bug == "loss_mean")
        cap.loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.params()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", default="ok", choices=BUGS)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    step(args.out, args.bug)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
