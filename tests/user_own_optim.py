"""A user's own TP training step with their OWN torch.optim.Optimizer subclasses (DTensor plan),
captured with `tpdiag.capture` over two steps (--opt):

  adafactor   Adafactor's unfactored form (elementwise, its update clipped by the whole tensor's RMS,
              a DTensor reduction): correct
  muon        Muon on the hidden matrices (Newton-Schulz orthogonalisation of the momentum, in bf16
              as Muon runs it) that gathers each sharded grad whole first: correct
  muon_shard  the same Muon orthogonalising each rank's shard (`to_local()`): the classic TP bug -
              the update of a sharded matrix is another matrix
  sgdw        SGD with momentum and decoupled weight decay: correct
  sgdw_rank   the same, with a rank-conditional decay left in: rank 1 decays its shards twice
  rmsprop     torch's own RMSprop (momentum, weight decay) - no class of the user's: correct
  torch_muon  torch's own Muon on the 2-D hidden matrices and torch's AdamW on the rest, two
              optimizers stepped one after the other, as its docs combine them: correct (skipped by
              the tests where the installed torch has no torch.optim.Muon)

The hidden matrices' fallback in the user's Muon (embeddings, head, biases) is momentum SGD inside the
same optimizer.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_own_optim.py --out DIR --opt muon_shard
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


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t):
    return t.to_local() if is_dtensor(t) else t


class Adafactor(torch.optim.Optimizer):
    """Adafactor's unfactored form (every parameter's own second moment) with its update clipping:
    the update divided by max(1, RMS(update) / clip), the RMS over the whole tensor (a DTensor
    reduction: every rank's shards)."""

    def __init__(self, params, lr=1e-2, decay=0.8, eps=1e-30, clip=1.0):
        super().__init__(params, dict(lr=lr, decay=decay, eps=eps, clip=clip))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                beta2 = 1.0 - st["step"] ** -group["decay"]
                v = st["exp_avg_sq"]
                v.mul_(beta2).add_(p.grad * p.grad + group["eps"], alpha=1 - beta2)
                u = p.grad / v.sqrt()
                rms = u.pow(2).mean().sqrt()
                u = u / torch.clamp(rms / group["clip"], min=1.0)
                p.add_(u, alpha=-group["lr"])


def newton_schulz(g, steps=5, eps=1e-7):
    """Muon's quintic Newton-Schulz iteration: the nearest semi-orthogonal matrix, in bf16."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    x = x / (x.norm() + eps)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    if tall:
        x = x.T
    return x.to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for groups with muon=True (hidden matrices), momentum SGD for the rest."""

    def __init__(self, params, lr=2e-2, momentum=0.95, weight_decay=0.01, per_shard=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, muon=False))
        self.per_shard = per_shard

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = st["momentum_buffer"]
                buf.mul_(mu).add_(p.grad)
                g = p.grad.add(buf, alpha=mu)  # Nesterov
                if not group["muon"]:
                    p.add_(g, alpha=-lr * 0.1)
                    continue
                if self.per_shard:
                    # the mistake: each rank orthogonalises its own shard
                    o = newton_schulz(local(g))
                    local(p).mul_(1 - lr * group["weight_decay"])
                    local(p).add_(o, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))
                    continue
                if is_dtensor(g):
                    from torch.distributed.tensor import distribute_tensor

                    o = newton_schulz(g.full_tensor())
                    o = distribute_tensor(o, p.device_mesh, p.placements)
                else:
                    o = newton_schulz(g)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(o, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))


class SGDW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, momentum=0.9, weight_decay=0.1, rank_decay=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.rank_decay = rank_decay

    @torch.no_grad()
    def step(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = p.grad.clone()
                else:
                    st["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                w = local(p)
                if wd:
                    w.mul_(1 - lr * wd)
                    if self.rank_decay and rank > 0:
                        # the mistake: a decay once done by the non-zero ranks of a data-parallel
                        # group before their all-reduce, left in
                        w.mul_(1 - lr * wd)
                w.add_(local(st["momentum_buffer"]), alpha=-lr)


OPTS = ("adafactor", "muon", "muon_shard", "sgdw", "sgdw_rank", "rmsprop", "torch_muon")


def make_opts(model, opt: str) -> list:
    """The optimizers the loop steps, in order."""
    hidden = [model.up.weight, model.down.weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    if opt == "adafactor":
        return [Adafactor(model.parameters())]
    if opt == "rmsprop":
        return [torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=0.01)]
    if opt == "torch_muon":
        return [torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-3)]
    if opt.startswith("muon"):
        return [Muon([{"params": hidden, "muon": True}, {"params": rest}], per_shard=opt == "muon_shard")]
    # no decay on the embedding and the biases (as most recipes do)
    decay = [*hidden, model.head.weight]
    rest = [p for p in model.parameters() if all(p is not d for d in decay)]
    return [SGDW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], rank_decay=opt == "sgdw_rank")]


def steps(out: str, opt_name: str) -> None:
    """Two training steps of the user's loop, captured to `out` (the process group is up)."""
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = TinyLM()
    plan = tp_plan()
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)
    opts = make_opts(model, opt_name)
    g = torch.Generator().manual_seed(1)
    loss_ctx = nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as loss_ctx

    with tpdiag.capture(model, out=out, plan=plan, seed=0) as cap:
        for step in range(2):
            if step:
                cap.next_step()
            ids = torch.randint(0, VOCAB, (4, 32), generator=g)  # more tokens than a matrix's columns
            labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
            cap.batch(input_ids=ids, labels=labels)
            logits = model(ids)
            with loss_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                cap.loss(loss)
                loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            cap.params()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--opt", default="adafactor", choices=OPTS)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    steps(args.out, args.opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
