"""Capture one training step under torchrun, at any TP degree, then diff two captures.

    torchrun --standalone --nproc-per-node 1 examples/capture_torchrun.py --out runs/cap-tp1
    torchrun --standalone --nproc-per-node 2 examples/capture_torchrun.py --out runs/cap-tp2
    tpdiag diff runs/cap-tp1 runs/cap-tp2

With --dp D the world is a D x (world/D) mesh ("dp", "tp"): TP runs inside each "tp" row and
the capture records the TP group that holds rank 0 (pass group=mesh["tp"]).

The model here is tpdiag's tiny Llama so the script runs anywhere; put your own model, plan,
batch and loss in its place. What matters is the same weights (one seed, full model, then
shard), the same batch, and `tpdiag.capture` around the step.
"""
from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpdiag

IGNORE = -100

# Plain local shards with no DTensor marker (ColwiseParallel's default use_local_output=True):
# say what they are. Unlisted ones are inferred from the shape against the reference capture.
LAYOUTS = {
    "layers.*.attention.w[qkv]": "shard:-1",
    "layers.*.feed_forward.w[13]": "shard:-1",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="capture directory")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = dp x tp)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # Determinism in one place: seed, deterministic algorithms, no TF32, one CPU thread (CPU
    # GEMM blocking depends on the thread count, so TP=1 and TP=2 must use the same).
    tpdiag.set_deterministic(seed=args.seed, cpu_threads=1)

    target = tpdiag.builtin_target("tiny-llama")  # the FULL model, identical on every rank
    model, plan = target.model.to(device), target.plan
    if args.dp < 1 or world % args.dp:
        raise SystemExit(f"--dp {args.dp}: must divide the world size {world}")
    tp = world // args.dp
    tp_mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, plan)

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=g).to(device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        loss_ctx = loss_parallel()  # the logits are vocab-sharded DTensors
    else:
        loss_ctx = nullcontext()

    # (A real data-parallel job would also all-reduce grads across "dp" before the step.)
    with tpdiag.capture(model, out=args.out, plan=plan, layouts=LAYOUTS, seed=args.seed,
                        group=tp_mesh) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        cap.logits(logits)
        with loss_ctx:
            with torch.no_grad():
                lp = -F.cross_entropy(logits.detach().flatten(0, -2), labels.flatten(),
                                      ignore_index=IGNORE, reduction="none")
            cap.logprobs(lp)
            loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)
            cap.loss(loss)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.params()

    if dist.get_rank() == 0:
        print(f"capture written to {args.out} (TP={tp}, DP={args.dp})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
