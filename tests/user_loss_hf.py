"""tests/user_loss_shard.py's captured step on a model laid out as an HF CausalLM: the root holds
the body as `self.model` and the head as `self.lm_head` (LlamaForCausalLM's names), so the root
records as "(root)" and its `model` child keeps "model" (records/keys.ROOT_NAMESAKE). The loss and
its mistakes (--bug) are user_loss_shard's: entropy_grad's normaliser all-reduced with an identity
backward leaves the loss bitwise and moves every row of the logits' grad 2e-3 of itself."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag
from user_loss_shard import BETA, entropy
from user_opt_shard import DIM, HIDDEN, VOCAB


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        return h + self.down(F.gelu(self.up(h)))


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"model.up": ColwiseParallel(), "model.down": RowwiseParallel(),
            "lm_head": ColwiseParallel(use_local_output=False)}


def step(out: str, bug: str) -> None:
    tp = dist.get_world_size()
    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    model = CausalLM()
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
