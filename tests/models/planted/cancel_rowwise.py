"""A correct row-parallel MLP whose two halves nearly cancel (helper hbug12): `down` reads the
hidden twice (`cat([h, h])`) with weights [K a, -K a + b] - a difference of two large terms, as a
model that learned to subtract one feature path from another. Plan: `mlp.down`
`RowwiseParallel(input_layouts=Replicate())` (torch's own, correct). In bf16 each rank's partial
(K = 30 times the output) is rounded to bf16 before the all-reduce - a rounding TP=1's one GEMM
never makes - so TP=2 is further from the float64 value than TP=1 by far more than 8 of TP=1's
roundings, yet by one rounding of the partials: rounding, not a bug. Vocab 32, hidden 32.

  cancel_rowwise       the model above (K = 30)
  cancel_rowwise_deep  two such blocks: the second's inputs already differ by the first's rounding

    tpdiag compare --model py:tests/models/planted/cancel_rowwise.py:cancel_rowwise --tp 1,2 --dtype bfloat16
tests/test_partials_cancel.py.
"""
import torch
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 32, 64, 2, 8
K = 30.0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, FF // 2, bias=False)
        self.down = nn.Linear(FF, DIM, bias=False)
        with torch.no_grad():
            a = torch.randn(DIM, FF // 2) / FF ** 0.5
            self.down.weight.copy_(torch.cat([K * a, -K * a + torch.randn(DIM, FF // 2) / FF ** 0.5], 1))

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(torch.cat([h, h], -1))


class LM(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MLP() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for mlp in self.blocks:
            h = h + mlp(h)
        return self.head(self.norm(h))


def _target(blocks):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return tpdiag.Target(model=LM(blocks), plan={"blocks.*.down": RowwiseParallel(input_layouts=Replicate())},
                         vocab_size=VOCAB, inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def cancel_rowwise():
    return _target(1)


def cancel_rowwise_deep():
    return _target(2)
