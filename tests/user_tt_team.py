"""A torchtitan-style team's own pretraining step, written from scratch (helper hcap19): its own
`Transformer.forward(tokens)` (RMSNorm, RoPE, GQA attention through SDPA, SwiGLU FFN, output tied
to the embedding), its own `parallelize(model, tp_mesh)` with sequence parallelism
(`SequenceParallel` norms, `PrepareModuleInput`, `loss_parallel`), its own loop (AdamW, grad
clipping over DTensor grads, fp32, 3 steps), one step recorded with `tpdiag.capture`.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_tt_team.py --out DIR [--bug B]
    tpdiag diff DIR_TP1 DIR_TP2

  none        correct
  tie_before  the output tied to the embedding BEFORE the plan (torchtitan re-ties after it):
              `parallelize_module` gives each module a new DTensor Parameter, so at TP > 1 the
              head and the embedding are two weights, trained apart
  sp_noprep   the attention left as in the team's plan without sequence parallelism (q/k/v
              `ColwiseParallel()`, wo `RowwiseParallel()`, no `PrepareModuleInput`) while its norm
              is `SequenceParallel(use_local_output=True)`: q/k/v take the rank's sequence shard
              for the whole sequence - each rank attends within its own positions only
  clip_local  clipping by the norm of each rank's local shards (`to_local()`): the coefficient
              differs by rank and from TP=1's; the ranks' replicated norm weights step apart

--dump FILE (default OUT.dump.pt) writes every step's loss and grad norm, the first step's logits,
every step's grads (whole) and the final parameters, to check that the capture changes no bit
(`step(OUT, "none:nocap")` runs the same loop without it).
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

VOCAB, DIM, N_HEADS, N_KV, FFN, SEQ, BATCH, SEED = 64, 32, 4, 2, 64, 8, 2, 7
MAX_NORM = 0.5          # below the grad norm of every step: the clip acts


def rope_cache(head_dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(end).float(), freqs)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x, cos, sin):  # x: (bs, seq, heads, head_dim)
    return x * cos[None, :, None, :] + rotate_half(x) * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = N_HEADS, N_KV, DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, cos, sin):
        bs, seqlen, _ = x.shape
        # -1: the heads this rank holds (all of them at TP=1)
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, cos[:seqlen], sin[:seqlen]), apply_rope(xk, cos[:seqlen], sin[:seqlen])
        n_rep = self.n_heads // self.n_kv_heads
        xk = xk.repeat_interleave(n_rep, dim=2)
        xv = xv.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                             xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        cos, sin = rope_cache(DIM // N_HEADS, 4 * SEQ)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))

    def tie(self):
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def tp_plan(bug: str) -> tuple[dict, dict]:
    """The team's TP plan: (block plan per layer, top-level plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    if bug == "sp_noprep":
        # the attention's entries as they were before sequence parallelism, the norm's output local
        del block["attention"]
        block["attention_norm"] = SequenceParallel(use_local_output=True)
        block["attention.wo"] = RowwiseParallel()
    return block, top


def parallelize(model: Transformer, tp_mesh, bug: str) -> dict:
    """Shard the model in place; returns the whole plan as {fqn: style} (for tpdiag's labels)."""
    from torch.distributed.tensor.parallel import parallelize_module

    block, top = tp_plan(bug)
    plan = dict(top)
    parallelize_module(model, tp_mesh, top)
    for lid, layer in model.layers.items():
        parallelize_module(layer, tp_mesh, block)
        plan.update({f"layers.{lid}.{k}": v for k, v in block.items()})
    return plan


def clip(model, max_norm: float, bug: str):
    params = [p for p in model.parameters() if p.grad is not None]
    if bug == "clip_local":
        from torch.distributed.tensor import DTensor

        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        total = torch.nn.utils.get_total_norm(local)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return total.full_tensor() if hasattr(total, "full_tensor") else total


def whole(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def step(out: str | None, variant: str, steps: int = 3, capture_step: int = 0, oracle=None,
         dump: str | None = None) -> None:
    """The team's loop in the process group already running: `variant` is a --bug value, with
    ":nocap" the same loop without the capture, ":nonorm" without `cap.grad_norm`; the dump goes to `dump` (or OUT.dump.pt)."""
    bug, _, mode = variant.partition(":")
    dump = dump or (f"{out}.dump.pt" if out else None)
    if mode == "nocap":
        out = None
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=SEED, cpu_threads=1)
    model = Transformer()
    if bug == "tie_before":
        model.tie()
    tp_mesh, plan = None, None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        tp_mesh = init_device_mesh("cpu", (tp,))
        plan = parallelize(model, tp_mesh, bug)
    if bug != "tie_before":
        model.tie()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(SEED + 1)
    rec = {"loss": [], "grad_norm": [], "grads": [], "logits": None}
    for i in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        recording = out is not None and i == capture_step
        cm = (tpdiag.capture(model, out=out, plan=plan, seed=SEED, group=tp_mesh,
                             oracle=oracle or None) if recording else nullcontext())
        with cm as cap:
            if recording:
                cap.batch(input_ids=inputs, labels=labels)
            logits = model(inputs)
            if recording:
                cap.logits(logits)
            with F_loss_parallel(tp):
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                if recording:
                    cap.loss(loss)
                loss.backward()
            if i == 0:
                rec["logits"] = whole(logits)
            rec["grads"].append({n: whole(p.grad) for n, p in model.named_parameters()})
            norm = clip(model, MAX_NORM, bug)
            if recording and mode != "nonorm":
                cap.grad_norm(norm)
            opt.step()
            opt.zero_grad()
            if recording:
                cap.params()
        rec["loss"].append(whole(loss))
        rec["grad_norm"].append(whole(norm))
    rec["params"] = {n: whole(p) for n, p in model.named_parameters()}
    if dump and dist.get_rank() == 0:
        torch.save(rec, dump)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="capture directory")
    ap.add_argument("--bug", default="none", choices=["none", "tie_before", "sp_noprep", "clip_local",
                                                      "clip_local:nonorm"])
    ap.add_argument("--capture-step", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--oracle", nargs="*", default=None, help="module globs for capture(oracle=)")
    ap.add_argument("--dump", help="write losses, logits, grads, params (rank 0) to this file")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    step(args.out, args.bug, args.steps, args.capture_step, args.oracle, args.dump)
    dist.destroy_process_group()


def F_loss_parallel(tp: int):
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if tp > 1 else nullcontext()


if __name__ == "__main__":
    main()
