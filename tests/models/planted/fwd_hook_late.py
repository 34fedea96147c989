"""A user's forward hook set up lazily (lead, session 17): a Llama-ish MLP LM whose forward, on its
first call, registers a hook on w2 that damps w2's output (a residual scale the user bolted on
without touching the module). The model is correct at every degree: w1 column-parallel, w2
row-parallel, the hook after the plan on the same module object.

  damped      the lazy hook; run with --steps 3 so a second and third step run after the first call

    tpdiag compare --model py:tests/models/planted/fwd_hook_late.py:damped --tp 1,2 --steps 3
"""
import torch
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 64, 32, 64


def damp(module, args, out):
    return out * 0.5


class DampedMLPLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.hooked = False

    def forward(self, input_ids):
        if not self.hooked:
            self.w2.register_forward_hook(damp)
            self.hooked = True
        h = self.embed(input_ids)
        h = h + self.w2(torch.nn.functional.silu(self.w1(h)))
        return self.head(h)


def damped():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=DampedMLPLM(), plan={"w1": ColwiseParallel(), "w2": RowwiseParallel()}, vocab_size=VOCAB)
