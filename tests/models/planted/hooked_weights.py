"""A user's hooks on weights under tpdiag's fixes (red team hred15, case 4): a Llama-ish MLP LM,
w1 column-parallel and w2 row-parallel by a DTensor plan, in which the user

  hooked_grad   clips w2's weight grad with a hook of their own (`p.register_hook`), and
  hooked_param  computes the replicated LM head's weight through a parametrization
                (`parametrize.register_parametrization`, weight = original * 2; torch's
                parallelize_module refuses a parametrized module it shards).

The fixes' fp32 carry (grad accumulation's window, every world with a carrying fix on) cannot carry
either: a hooked weight keeps the stock grad (its hook must see and change it), a computed one is no
leaf (its carry reached no parameter: `original` got NO grad before hred15). Their stock grads are
not covered by "with every fix on, the model is bitwise identical across TP", and the verdict says
so (summary.json not_carried). `plain` is the same model with neither.

    tpdiag compare --model py:tests/models/planted/hooked_weights.py:hooked_grad --tp 1,2 --fix all
"""
import torch
from torch import nn
from torch.nn.utils import parametrize

import tpdiag

VOCAB, DIM, HIDDEN = 64, 32, 64


class Doubled(nn.Module):
    def forward(self, w):
        return w * 2


class MLPLM(nn.Module):
    def __init__(self, hook: bool, param: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if hook:
            self.w2.weight.register_hook(lambda g: g.clamp(-0.5, 0.5))
        if param:
            parametrize.register_parametrization(self.head, "weight", Doubled())

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.w2(torch.nn.functional.silu(self.w1(h)))
        return self.head(h)


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def hooked_grad():
    return tpdiag.Target(model=MLPLM(hook=True, param=False), plan=_plan(), vocab_size=VOCAB)


def hooked_param():
    return tpdiag.Target(model=MLPLM(hook=False, param=True), plan=_plan(), vocab_size=VOCAB)


def plain():
    return tpdiag.Target(model=MLPLM(hook=False, param=False), plan=_plan(), vocab_size=VOCAB)
