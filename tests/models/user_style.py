"""A user's own model as users write them: `forward(self, tokens)` (torchtitan's signature),
the LM head reading a slice of the final norm's output (HF's `logits_to_keep`), and the head
planned as a plain `ColwiseParallel()` - torch's default `use_local_output=True`, so each rank
returns its local vocab shard, unmarked.

Targets: `target` (that plan), `target_marked` (the same model, head returns a vocab-sharded
DTensor), `target_head_only` (only the head is split, its output gathered: the forward and the
loss are TP-invariant, the first difference is the head's dgrad into the final norm),
`target_local_loss` (a user loss written for local shards, checking it gets them),
`target_bad_loss` (a user loss that indexes local shards with global labels: IndexError at
TP > 1), `target_bad_plan` (a plan entry naming no module).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 128, 64, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class UserLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, keep: int = 0):
        h = self.norm(self.block(self.embed(tokens)))
        # as HF's causal-LM heads do: a view of the norm's output, not the output itself
        return self.head(h[:, -keep:, :])


def _plan(head):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"embed": RowwiseParallel(input_layouts=Replicate()),
            "block.fc1": ColwiseParallel(), "block.fc2": RowwiseParallel(), "head": head}


def target():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=UserLM(), plan=_plan(ColwiseParallel()), vocab_size=VOCAB)


def target_marked():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return tpdiag.Target(model=UserLM(), plan=_plan(head), vocab_size=VOCAB)


def target_head_only():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return tpdiag.Target(model=UserLM(), plan={"head": ColwiseParallel(output_layouts=Replicate())},
                         vocab_size=VOCAB)


def _world():
    return dist.get_world_size() if dist.is_initialized() else 1


def local_loss(logits, labels):
    # written for what a plain ColwiseParallel head hands back: this rank's slice of the vocab
    assert type(logits) is torch.Tensor and logits.shape[-1] == VOCAB // _world(), logits.shape
    return logits.float().square().mean()


def target_local_loss():
    t = target()
    t.loss = local_loss
    return t


def bad_loss(logits, labels):
    # global vocab ids against a local vocab shard: IndexError (Target N is out of bounds)
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)


def target_bad_loss():
    t = target()
    t.loss = bad_loss
    return t


def target_bad_plan():
    t = target()
    t.plan["blocks.*.fc1"] = t.plan.pop("block.fc1")  # a typo: no module is called blocks.N
    return t
