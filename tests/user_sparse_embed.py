"""A user's own TP training step whose token embedding is `nn.Embedding(sparse=True)` (its grad a
sparse COO tensor), replicated on every rank (not in the plan), captured with `tpdiag.capture` over
two steps (--variant):

  sparse_adam  torch's SparseAdam for the embedding, AdamW for the rest (as torch's docs pair them): correct
  sgd          torch's SGD for every parameter (it steps sparse grads as they are): correct
  rows         sgd with the embedding cut by vocab rows by hand, Megatron's VocabParallelEmbedding
               (each rank its own rows as a plain parameter, other tokens masked, the outputs
               all-reduced): correct
  rows_adam    rows stepped by SparseAdam (and AdamW): correct, but each rank's SparseAdam steps its own
               plain shard, which tpdiag cannot re-run as the whole tensor's step (not judged)
  sum_sync     sparse_adam whose loop all-reduces the embedding's sparse grad over the TP group as if
               the ranks held other tokens (a data-parallel habit): the grad SparseAdam steps is TP
               times the one autograd made, on every rank

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_sparse_embed.py --out DIR --variant sgd
    tpdiag diff DIR_TP1 DIR_TP2
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 32, 16, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=True)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


class _SumForward(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class VocabRows(nn.Module):
    """This rank's rows of a sparse embedding: tokens outside them read zeros, the ranks' outputs summed."""

    def __init__(self, full: nn.Embedding, rank: int, tp: int):
        super().__init__()
        n = full.num_embeddings // tp
        self.lo, self.hi = rank * n, rank * n + n
        self.weight = nn.Parameter(full.weight.detach()[self.lo:self.hi].clone())

    def forward(self, ids):
        out = (ids < self.lo) | (ids >= self.hi)
        h = F.embedding((ids - self.lo).masked_fill(out, 0), self.weight, sparse=True)
        return _SumForward.apply(h.masked_fill(out[..., None], 0.0))


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel(),
            "head": ColwiseParallel(use_local_output=False)}


VARIANTS = ("sparse_adam", "sgd", "rows", "rows_adam", "sum_sync")


def make_opts(model, variant: str) -> list:
    if variant in ("sparse_adam", "rows_adam", "sum_sync"):
        rest = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
        return [torch.optim.SparseAdam([model.embed.weight], lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)]
    return [torch.optim.SGD(model.parameters(), lr=0.5)]


def steps(out: str, variant: str) -> None:
    """Two training steps of the user's loop, captured to `out` (the process group is up)."""
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = TinyLM()
    plan = tp_plan()
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)
        if variant.startswith("rows"):
            model.embed = VocabRows(model.embed, dist.get_rank(), tp)
    opts = make_opts(model, variant)
    g = torch.Generator().manual_seed(1)
    loss_ctx = nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel as loss_ctx

    layouts = {"embed.weight": "shard:0"} if variant.startswith("rows") else None
    with tpdiag.capture(model, out=out, plan=plan, layouts=layouts, seed=0) as cap:
        for step in range(2):
            if step:
                cap.next_step()
            ids = torch.randint(0, VOCAB // 2, (2, 8), generator=g)  # half the rows untouched
            labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
            cap.batch(input_ids=ids, labels=labels)
            logits = model(ids)
            with loss_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                cap.loss(loss)
                loss.backward()
            if variant == "sum_sync" and tp > 1:
                dist.all_reduce(model.embed.weight.grad)  # the mistake: every rank holds the whole grad already
            for opt in opts:
                opt.step()
                opt.zero_grad()
            cap.params()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="sparse_adam", choices=VARIANTS)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    steps(args.out, args.variant)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
