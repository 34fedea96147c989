"""A custom model for `tpdiag compare --model py:examples/py_target.py:target`.

FUNC() returns a `tpdiag.Target`: the full, unsharded model (tpdiag seeds the RNG before the
call, so every rank and degree builds the same weights), its tensor-parallel plan, and - both
optional - how to make a batch and how to compute the loss.

    tpdiag compare --model py:examples/py_target.py:target --tp 1,2,4
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, LAYERS = 256, 128, 512, 2
BATCH, SEQ, PROMPT = 2, 16, 6
IGNORE = -100


class Block(nn.Module):
    """Pre-norm residual MLP block: fc1 column-parallel, fc2 row-parallel (one all-reduce)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyMLPLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def plan() -> dict:
    """{fqn pattern: ParallelStyle}, as torch's parallelize_module takes it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "embed": RowwiseParallel(input_layouts=Replicate()),           # vocab-parallel embedding
        "blocks.*.fc1": ColwiseParallel(),
        "blocks.*.fc2": RowwiseParallel(),
        # Logits stay vocab-sharded DTensors: the loss runs vocab-parallel (loss_parallel).
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def inputs(g: torch.Generator) -> dict:
    """Prompt + response batch: only response tokens are trained on (labels -100 elsewhere)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    labels[:, :PROMPT] = IGNORE
    return {"input_ids": ids, "labels": labels}


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over response tokens divided by their count. `logits` arrive as the model returns
    them: a vocab-sharded DTensor at TP > 1, which cross_entropy handles under tpdiag's
    loss_parallel context."""
    total = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE,
                            reduction="sum")
    return total / (labels != IGNORE).sum()


def target() -> tpdiag.Target:
    model = TinyMLPLM()
    return tpdiag.Target(model=model, plan=plan(), vocab_size=VOCAB, inputs=inputs, loss=loss,
                         divisors={"vocab": VOCAB, "hidden": HIDDEN})


def target_meta(device: torch.device) -> tpdiag.Target:
    """The same target, opted in to the meta-device build by its `device` parameter: tpdiag
    calls it with the meta device (and under it), then allocates every parameter on the run's
    device and initialises each module by its own `reset_parameters()`, the RNG reseeded from
    (seed, module fqn) - no full CPU build per rank, the same weights at every degree.

        tpdiag compare --model py:examples/py_target.py:target_meta --tp 1,2
    """
    return target()
