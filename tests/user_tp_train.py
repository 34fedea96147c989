"""A user's own TP training script, written as a user writes one: plain torch, its own model,
its own DTensor plan (parallelize_module), its own optimizer loop. tpdiag appears only through
its public API (`import tpdiag`), and only in the run named `invariant`.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_tp_train.py --out x.safetensors

Writes every step's loss and grad norm and the final parameters (whole) to --out, from rank 0,
as RUN/loss, RUN/grad_norm and RUN/param.NAME for each RUN of --runs.
tests/test_public_api.py runs it at TP=1 and TP=2 and compares the files bit for bit.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN = 64, 32, 512  # the row-parallel `down` reduces over HIDDEN = 512


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
            "head": ColwiseParallel(use_local_output=False)}  # vocab-sharded logits


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """The usual global-norm clip (torch's clip_grad_norm_ refuses a mix of DTensor and plain
    grads, as here: the embedding is not sharded)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(
        [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def train(tp: int, steps: int, fixes: str | None, groups: int = 2, gemm: str = "per-group") -> dict:
    """`steps` AdamW steps from seed 0; fixes=None: plain torch, else under tpdiag.invariant."""
    if fixes is None:
        torch.manual_seed(0)
    else:
        import tpdiag

        tpdiag.set_deterministic(seed=0)
    model = TinyLM()  # the whole model, the same weights on every rank...
    plan = tp_plan()
    if tp > 1:  # ...then sharded
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    if fixes is None:
        switch, clip = nullcontext(), clip_grad_norm
    else:
        switch = tpdiag.invariant(model, plan, fixes=fixes, tree_groups=groups, group_gemm=gemm)
        clip = tpdiag.clip_grad_norm_
    losses, norms = [], []
    with switch:
        for _ in range(steps):
            logits = model(ids)
            if tp > 1:
                from torch.distributed.tensor.parallel import loss_parallel

                loss_ctx = loss_parallel()  # the logits are vocab-sharded DTensors
            else:
                loss_ctx = nullcontext()
            with loss_ctx:
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                loss.backward()
            norms.append(clip(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad()
            losses.append(loss)

    from torch.distributed.tensor import DTensor

    def whole(t):
        t = t.detach()
        return t.full_tensor() if isinstance(t, DTensor) else t

    out = {f"param.{n}": whole(p).contiguous() for n, p in model.named_parameters()}
    out["loss"] = torch.stack([whole(x).float() for x in losses])
    out["grad_norm"] = torch.stack([whole(x).double() for x in norms])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", default="invariant",
                    help="'invariant', 'stock' (no tpdiag at all: the negative control) or both, "
                         "comma-separated; stock runs first, before anything of tpdiag is called")
    ap.add_argument("--fixes", default="all", help="what the invariant run turns on")
    ap.add_argument("--tree-groups", type=int, default=2)
    ap.add_argument("--group-gemm", default="per-group")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    torch.set_num_threads(1)  # CPU GEMM blocking follows the thread count: the same at every TP
    runs = args.runs.split(",")
    out = {}
    for run in ("stock", "invariant"):
        if run in runs:
            res = train(tp, args.steps, None if run == "stock" else args.fixes, args.tree_groups,
                        args.group_gemm)
            out.update({f"{run}/{k}": v for k, v in res.items()})
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
