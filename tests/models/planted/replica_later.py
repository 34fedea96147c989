"""Per-rank state read later than the next step, or by a module beside its owner (helper hbug13).
An `observer` keeps the amax of the activations it sees in a BUFFER; each rank looks at its own
share of the tokens (as under sequence parallelism) and the MAX all-reduce that makes them one
amax is forgotten: the ranks keep different amaxes. A `quant` module fake-quantises with that amax.

  after_warmup  the observer calibrates at the first step only; `quant` (inside the observer's
                block) starts quantising after one warm-up step: the amax written at step 0 is
                first read at step 2 (--steps 3) - a bug
  beside        the observer writes at every step and returns its input as is; `quant`, given the
                observer (shared scaling state, not a submodule), reads the amax at the next step:
                the owner's own output never changes - a bug
  logged        the twin of both: nothing reads the amax (kept for the logs)

    tpdiag compare --model py:tests/models/planted/replica_later.py:after_warmup --tp 1,2 --steps 3
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, amax):
        step = amax / 127
        return torch.round(y / step).clamp(-127, 127) * step

    @staticmethod
    def backward(ctx, g):
        return g, None


class Observer(nn.Module):
    def __init__(self, once):
        super().__init__()
        self.register_buffer("amax", torch.ones(()))
        self.register_buffer("steps", torch.zeros(()))  # forwards seen (a step each)
        self.once = once

    def forward(self, x):
        r, n = rank_world()
        with torch.no_grad():
            if not self.once or self.steps.item() == 0:
                share = x.shape[1] // n
                self.amax.copy_(x[:, r * share:(r + 1) * share].abs().amax())
            self.steps.add_(1)
        return x


class Quant(nn.Module):
    def __init__(self, observer, warmup):
        super().__init__()
        self.scaling = [observer]  # shared scaling state, not a submodule of its own
        self.warmup = warmup

    def forward(self, y):
        if self.scaling[0].steps.item() < self.warmup:
            return y
        return _FakeQuant.apply(y, self.scaling[0].amax)


class Block(nn.Module):
    def __init__(self, quant_warmup):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.observer = Observer(once=quant_warmup is not None and quant_warmup > 1)
        self.quant = Quant(self.observer, quant_warmup) if quant_warmup is not None else None

    def forward(self, x):
        y = self.lin(x)
        if self.quant is not None:
            y = self.quant(y)  # reads the amax the step before left
        self.observer(y)
        return x + y


class LM(nn.Module):
    def __init__(self, quant_warmup):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(quant_warmup)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.block(self.embed(tokens))))


def _target(quant_warmup):
    return tpdiag.Target(model=LM(quant_warmup), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def after_warmup():
    return _target(2)


def beside():
    return _target(1)


def logged():
    return _target(None)
