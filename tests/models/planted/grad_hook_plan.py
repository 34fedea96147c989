"""A user's grad hook on a weight, registered BEFORE the TP plan is applied (helper hhook16): a
Llama-ish MLP LM, w1 column-parallel and w2 row-parallel by a DTensor plan. The user scales or clips
a weight's grad with a hook of their own (`p.register_hook`). torch's parallelize_module replaces a
planned module's parameter with a new DTensor parameter, and a hook registered on the old one does
not come with it: the hook runs at TP=1 and silently not at TP > 1 - the same training, another
update by its layout.

  hook_init      w2's weight grad halved by a hook registered in the model's __init__
  hook_build     w1's weight grad clipped elementwise by a hook registered in the build function,
                 after the model is built and before tpdiag applies the plan
  hook_after     the correct twin: the same halving on w2, registered on the parameter the model
                 holds when it first runs (after the plan: the DTensor parameter at TP > 1)
  hook_replicated  a hook on the LM head, which the plan does not touch: it holds at every degree
  hook_logger    an observer on w2's grad (it keeps the grad's norm, returns nothing), registered
                 in __init__: dropped at TP > 1 too, but it changes no number
  hook_mixed     hook_build's clip on w1 (dropped) beside hook_replicated's halving on the head (kept)

    tpdiag compare --model py:tests/models/planted/grad_hook_plan.py:hook_init --tp 1,2
"""
import torch
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 64, 32, 64


def halve(g):
    return g * 0.5


def clip(g):
    return g.clamp(-1e-3, 1e-3)


NORMS = []


def log_norm(g):
    NORMS.append(float(g.norm()))


class MLPLM(nn.Module):
    def __init__(self, hook_w2_now=None, hook_w2_later: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if hook_w2_now is not None:
            self.w2.weight.register_hook(hook_w2_now)
        self.hook_w2_later = hook_w2_later

    def forward(self, input_ids):
        if self.hook_w2_later:
            # on the parameter the model holds now: parallelize_module has replaced it by then
            self.w2.weight.register_hook(halve)
            self.hook_w2_later = False
        h = self.embed(input_ids)
        h = h + self.w2(torch.nn.functional.silu(self.w1(h)))
        return self.head(h)


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def hook_init():
    return tpdiag.Target(model=MLPLM(hook_w2_now=halve), plan=_plan(), vocab_size=VOCAB)


def hook_build():
    model = MLPLM()
    model.w1.weight.register_hook(clip)
    return tpdiag.Target(model=model, plan=_plan(), vocab_size=VOCAB)


def hook_after():
    return tpdiag.Target(model=MLPLM(hook_w2_later=True), plan=_plan(), vocab_size=VOCAB)


def hook_replicated():
    model = MLPLM()
    model.head.weight.register_hook(halve)
    return tpdiag.Target(model=model, plan=_plan(), vocab_size=VOCAB)


def hook_logger():
    return tpdiag.Target(model=MLPLM(hook_w2_now=log_norm), plan=_plan(), vocab_size=VOCAB)


def hook_mixed():
    model = MLPLM()
    model.w1.weight.register_hook(clip)
    model.head.weight.register_hook(halve)
    return tpdiag.Target(model=model, plan=_plan(), vocab_size=VOCAB)
