"""Modules named with rich markup and HTML (`down[/]x`, `up[bold]`, `<script>`): torch allows any name
without a dot. The row-parallel one is the first divergence at TP=2, so its name is in every line."""
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

V = 64


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.blocks = nn.ModuleDict({"up[bold]<script>": nn.Linear(32, 64, bias=False),
                                     "down[/]x": nn.Linear(64, 32, bias=False)})
        self.head = nn.Linear(32, V, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        return self.head(self.blocks["down[/]x"](torch.relu(self.blocks["up[bold]<script>"](h))))


def target():
    # fnmatch reads [..] as a character class: the plan names them by prefix
    return tpdiag.Target(model=LM(), plan={"blocks.up*": ColwiseParallel(), "blocks.down*": RowwiseParallel()},
                         vocab_size=V)
