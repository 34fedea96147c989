"""A user's residual MLP language model whose own block refuses a 4-way split in its forward (a kernel
of theirs written for TP <= 2): `compare --tp 1,2,4` runs TP=2 and fails TP=4 in the user's code.
fc1 column-parallel, fc2 row-parallel (one all-reduce): TP=2 differs by that sum's rounding."""
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 64, 32, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        if dist.is_initialized() and dist.get_world_size() == 4:
            raise RuntimeError("my fused kernel has no 4-way split")
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        return self.head(self.block(self.embed(input_ids)))


def target():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"block.fc1": ColwiseParallel(), "block.fc2": RowwiseParallel()}
    return tpdiag.Target(model=LM(), plan=plan, vocab_size=VOCAB)
