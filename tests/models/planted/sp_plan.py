"""Sequence parallelism through a DTensor plan (torchtitan's way), as a user writes the table:
the residual stream is sharded on the sequence between the blocks, so every norm that reads it
must be in the plan as `SequenceParallel()` - its weight is then a replicated DTensor whose grad
DTensor all-reduces.

  bug   the first norm left out of the plan: it runs on each rank's local sequence slice as a
        plain module, its (plain, replicated) weight's grad covers that slice only and is never
        all-reduced - the forward is exact, the replicas drift at the step
  good  both norms in the plan
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, FF, B, S = 32, 32, 64, 2, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)
        self.final_norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(self.final_norm(h))


def _plan(norm_in_plan):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            "final_norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    if norm_in_plan:
        plan["norm"] = SequenceParallel()
    return plan


def _target(norm_in_plan):
    return tpdiag.Target(model=LM(), plan=_plan(norm_in_plan), vocab_size=V,
                         inputs=lambda g: torch.randint(0, V, (B, S), generator=g))


def good():
    return _target(True)


def bug():
    return _target(False)
