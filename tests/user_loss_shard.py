"""A user's own TP training step whose loss adds an entropy bonus to loss_parallel's cross-entropy
(DTensor plan, the head's logits vocab-sharded), captured with `tpdiag.capture` (--bug):

  entropy_ok     the entropy written by hand on the rank's vocab shard with the whole vocabulary's
                 normaliser (the max and the exp-sum all-reduced by torch.distributed.nn's
                 all_reduce, whose backward sums the ranks' grads of it), its p log p summed over
                 the ranks
  entropy_grad   the same, the exp-sum all-reduced with an identity backward (Megatron's g, right
                 for a cross-entropy whose every rank computes the same loss from it): here each
                 rank's entropy terms differ, so each rank's grad of the normaliser is its own
                 shard's share - the loss is bitwise, every row of the logits' grad 2e-3 off
  entropy_local  the same from the shard's OWN softmax (`log_softmax(logits.to_local())`, the
                 one-liner from a single-GPU codebase), the ranks' shard entropies summed: the loss
                 moves by 0.6% at TP=2, and every grad with it

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_loss_shard.py --out DIR --bug entropy_local
    tpdiag diff DIR_TP1 DIR_TP2
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpdiag
from user_opt_shard import VOCAB, TinyLM, tp_plan

BETA = 0.01
BUGS = ("entropy_ok", "entropy_local", "entropy_grad")


class _Reduce(torch.autograd.Function):
    """All-reduce forward; each rank's grad is its own shard's: identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def entropy(logits, bug: str) -> torch.Tensor:
    """Per token, from a vocab-sharded DTensor (TP > 1) or the whole logits."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        lp = torch.log_softmax(logits.float(), -1)
        return -(lp.exp() * lp).sum(-1)
    z = logits.to_local().float()
    if bug == "entropy_local":  # the mistake: this shard's own softmax
        lp = torch.log_softmax(z, -1)
    else:
        m = z.detach().amax(-1, keepdim=True)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        s = torch.exp(z - m).sum(-1, keepdim=True)
        if bug == "entropy_grad":  # the mistake: identity backward, each rank's share of dL/ds only
            s = _Reduce.apply(s)
        else:
            from torch.distributed.nn.functional import all_reduce

            s = all_reduce(s)
        lp = z - m - torch.log(s)
    return _Reduce.apply(-(lp.exp() * lp).sum(-1))


def step(out: str, bug: str) -> None:
    """One training step of the user's loop, captured to `out` (the process group is up)."""
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
    loss_ctx = nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as loss_ctx
    with tpdiag.capture(model, out=out, plan=plan, seed=0) as cap:
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        with loss_ctx():
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            if tp > 1:
                ce = ce.full_tensor()
        loss = ce - BETA * entropy(logits, bug).mean()
        cap.loss(loss)
        with loss_ctx():
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.params()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", default="entropy_ok", choices=BUGS)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    step(args.out, args.bug)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
