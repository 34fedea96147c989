"""A user's small LM trained with gradient accumulation (tpdiag's --micro-batch): at TP=1 the
micro-batches' grads are summed in another order than one whole-batch backward, so the grads and
the grad norm differ by rounding - nothing is sharded."""
import torch
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 64, 64, 8, 16


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.down(torch.relu(self.up(h))))


def target():
    return tpdiag.Target(model=LM(), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
