"""torchtitan's own Llama3 ("debugmodel", cut to 2 layers) sharded by torchtitan itself, one step
under `tpdiag.invariant` - only tpdiag's public API. Writes the logits and the loss (and, with
--backward, the parameters after one AdamW step) to --out from rank 0.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_torchtitan_step.py --out x.safetensors

CPU: torchtitan >= 0.3 builds its language models with flex attention, which has no backward on
the CPU, so there the step is the forward and the loss (--backward needs a GPU).
"""
from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpdiag


def build(world: int, device: torch.device):
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = model_registry("debugmodel", attn_backend="flex").model
    cfg.layers = cfg.layers[:2]
    set_llama3_sharding_config(cfg, enable_sp=False)
    model = cfg.build()
    model.init_states(buffer_device=device)
    model.to(device)
    if world > 1:
        if device.type == "cpu":
            import torchtitan.distributed.parallel_dims as pd_mod

            pd_mod.device_type = "cpu"  # torchtitan assumes an accelerator for its mesh
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        model.parallelize(dims)
    return model, cfg.vocab_size


def plan_of(model) -> dict:
    """torchtitan has no plan dict: its Llama3 TP rules, by module kind - wo and w2 row-parallel,
    every other Linear (wqkv, w1, w3, lm_head) column-parallel. The same at every degree."""
    plan = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            plan[name] = "rowwise" if name.endswith(("attention.wo", "feed_forward.w2")) else "colwise"
    return plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--stock", action="store_true", help="without tpdiag.invariant")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tpdiag.set_deterministic(seed=1234, cpu_threads=1)
    model, vocab = build(world, device)
    plan = plan_of(model)
    g = torch.Generator().manual_seed(1235)
    ids = torch.randint(0, vocab, (2, 16), generator=g).to(device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    masks = model.get_attention_masks(positions=positions)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    switch = nullcontext() if args.stock else tpdiag.invariant(model, plan, fixes="all", tree_groups=2)
    grad = torch.enable_grad() if args.backward else torch.no_grad()
    if world > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        loss_ctx = loss_parallel()
    else:
        loss_ctx = nullcontext()
    with switch, grad:
        logits = model(ids, positions, masks)
        with loss_ctx:
            loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
            if args.backward:
                loss.backward()
        if args.backward:
            tpdiag.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    from torch.distributed.tensor import DTensor

    def whole(t):
        t = t.detach()
        return (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()

    out = {"logits": whole(logits), "loss": whole(loss).reshape(1)}
    if args.backward:
        out.update({f"param.{n}": whole(p) for n, p in model.named_parameters()})
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
