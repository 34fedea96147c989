"""torchtitan's own Llama3 (the `torchtitan` package) with torchtitan's own TP sharding, captured
in-process under torchrun at TP=1 and TP=2, then diffed by tpdiag.

    torchrun --standalone --nproc-per-node 1 examples/torchtitan_capture.py --out runs/tt-tp1
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_capture.py --out runs/tt-tp2
    tpdiag diff runs/tt-tp1 runs/tt-tp2

The model is torchtitan's "debugmodel" flavour (dim 256, 16 heads, vocab 2048) cut to --layers
layers; torchtitan's `set_llama3_sharding_config` + `Module.parallelize(ParallelDims)` shard
it, exactly as its trainer does for TP (no FSDP, no SP). tpdiag does not re-plan anything: the
capture's style labels are read back from the placements torchtitan gave each weight.

CPU: torchtitan >= 0.3 builds language models with flex attention only (its SDPA backend is
refused for them), and flex attention has no backward on CPU, so on CPU the step is the forward,
the logprobs and the loss (--backward needs a GPU). torchtitan also assumes an accelerator when
it builds its device mesh; on CPU its device type is pointed at "cpu".
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


def build(world: int, layers: int, device: torch.device):
    """torchtitan's debug Llama3, whole and seeded, then sharded by torchtitan for TP=world."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = model_registry("debugmodel", attn_backend="flex").model
    cfg.layers = cfg.layers[:layers]
    set_llama3_sharding_config(cfg, enable_sp=False)
    model = cfg.build()
    model.init_states(buffer_device=device)  # seeded by the caller: the same weights everywhere
    model.to(device)
    if world > 1:
        if device.type == "cpu":
            import torchtitan.distributed.parallel_dims as pd_mod

            pd_mod.device_type = "cpu"
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        model.parallelize(dims)
    return model, cfg.vocab_size


def plan_from_placements(model) -> dict:
    """{module: 'colwise' | 'rowwise'} read from the weights torchtitan sharded: a Linear split
    over its outputs (Shard(0)) is column-parallel, over its inputs (Shard(1)) row-parallel; an
    embedding split over its vocab (Shard(0)) is the vocab-parallel ('rowwise') embedding."""
    from torch.distributed.tensor import DTensor

    plan = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, DTensor) or w.ndim != 2 or not w.placements[0].is_shard():
            continue
        dim = w.placements[0].dim
        embed = isinstance(mod, torch.nn.Embedding)
        plan[name] = "rowwise" if (dim == 1) != embed else "colwise"
    return plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="capture directory")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="also the backward (needs a GPU)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tpdiag.set_deterministic(seed=args.seed, cpu_threads=1)
    model, vocab = build(world, args.layers, device)
    plan = plan_from_placements(model)

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, vocab, (2, 16), generator=g).to(device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    masks = model.get_attention_masks(positions=positions)
    grad = torch.enable_grad() if args.backward else torch.no_grad()
    if world > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        loss_ctx = loss_parallel()  # torchtitan's head returns vocab-sharded DTensor logits
    else:
        loss_ctx = nullcontext()

    with tpdiag.capture(model, out=args.out, plan=plan, seed=args.seed,
                        backward=args.backward) as cap, grad:
        cap.batch(tokens=ids, labels=labels)
        logits = model(ids, positions, masks)  # torchtitan's forward(tokens, positions, masks)
        cap.logits(logits)
        with loss_ctx:
            with torch.no_grad():
                lp = -F.cross_entropy(logits.detach().flatten(0, -2), labels.flatten(),
                                      ignore_index=IGNORE, reduction="none")
            cap.logprobs(lp)
            loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)
            cap.loss(loss)
            if args.backward:
                loss.backward()
    if dist.get_rank() == 0:
        print(f"capture written to {args.out} (torchtitan Llama3, TP={world}, "
              f"{'forward+backward' if args.backward else 'forward'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
