"""A user's own GPT-2-style model and gradient-accumulation loop, written as a user writes one:
plain torch (learned position embedding, LayerNorm, biases everywhere, GELU MLP, SDPA attention,
tied or untied LM head), its own DTensor plan, tpdiag only through `import tpdiag`.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/user_gpt2_accum.py --out x.safetensors

For each run of --runs (carry: under accumulate_grads; plain: the same loop without it, the
negative control), head (tied, untied) and micro-batch size (4: one piece of 4 sequences, 1: four
pieces of one), one step's whole grads and grad norm, written by rank 0 as
{RUN}/{HEAD}/mb{M}/grad.NAME and .../grad_norm. A NotCarried warning (a parameter whose grad
accumulate_grads did not carry) is an error here.
tests/test_accumulate_gpt2.py runs it at TP=1 and TP=2 and compares the files bit for bit.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 8, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        # q/k/v are column-parallel at TP > 1: this rank's heads only
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(DIM), Attention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.fc, self.fc_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def plan(tied: bool) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    p = {}
    for i in range(LAYERS):
        p.update({f"h.{i}.attn.q": ColwiseParallel(), f"h.{i}.attn.k": ColwiseParallel(),
                  f"h.{i}.attn.v": ColwiseParallel(), f"h.{i}.attn.proj": RowwiseParallel(),
                  f"h.{i}.fc": ColwiseParallel(), f"h.{i}.fc_proj": RowwiseParallel()})
    if not tied:  # a vocab-parallel head; the tied one stays replicated with the embedding
        p["lm_head"] = ColwiseParallel(use_local_output=False)
    return p


def step(tp: int, tied: bool, micro: int, accumulate: bool) -> dict:
    import tpdiag
    from torch.distributed.tensor import DTensor

    tpdiag.set_deterministic(seed=0)
    model = GPT(tied)
    pl = plan(tied)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), pl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    n = (labels != -100).sum()
    with tpdiag.invariant(model, pl, fixes="all", tree_groups=2):
        with tpdiag.accumulate_grads(model) if accumulate else nullcontext():
            for a in range(0, BATCH, micro):
                logits = model(ids[a:a + micro])
                if isinstance(logits, DTensor):
                    from torch.distributed.tensor.parallel import loss_parallel

                    ctx = loss_parallel()
                else:
                    ctx = nullcontext()
                with ctx:
                    loss = F.cross_entropy(logits.flatten(0, 1), labels[a:a + micro].flatten(),
                                           reduction="sum") / n
                    loss.backward()
        norm = tpdiag.clip_grad_norm_(model.parameters(), 1.0)

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous()

    out = {f"grad.{k}": whole(p.grad) for k, p in model.named_parameters()}
    out["grad_norm"] = whole(norm).reshape(1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="carry", help="carry, plain (no accumulate_grads) or both")
    args = ap.parse_args()
    import warnings

    import tpdiag

    warnings.simplefilter("error", tpdiag.NotCarried)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    out = {}
    for run in args.runs.split(","):
        for head in ("tied", "untied"):
            for micro in (BATCH, 1):
                res = step(tp, head == "tied", micro, run == "carry")
                out.update({f"{run}/{head}/mb{micro}/{k}": v for k, v in res.items()})
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
