"""A module called twice per step, each call under its own reentrant activation checkpoint
(helper hreview11). Backward recomputes the checkpoints in reverse order: the second call's
recompute runs first. Vocab 32, hidden 32; DTensor plans (ColwiseParallel up, RowwiseParallel
down), correct at every TP.

  twice_ok          one MLP applied twice (a looped / weight-shared block, as ALBERT does), each
                    application checkpointed: each segment's inner backward accumulates the weight
                    grad (the run had stopped, `param_grad ... listed twice`; now recorded once,
                    as the step's backward ends: rounding only)
  twice_plain       the same, no checkpointing (rounding only)
  twice_scaled      twice_ok whose MLP scales its hidden by BASE / its width (a width multiplier
                    read from the activation): at TP=2 the width is the rank's shard - a bug
  shared_act_ok     two checkpointed blocks sharing one nn.GELU module (rounding only; its two
                    calls' grads each recorded under their own call: tests/test_ckpt_recompute.py)
  shared_act_plain  the same, no checkpointing

    tpdiag compare --model py:tests/models/planted/ckpt_twice.py:shared_act_ok --tp 1,2
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tpdiag

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 32, 64, 2, 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ScaledMLP(MLP):
    def forward(self, x):
        h = F.gelu(self.up(x))
        return self.down(h * (HIDDEN / h.shape[-1]))


class LoopLM(nn.Module):
    def __init__(self, ckpt=True, mlp=MLP):
        super().__init__()
        self.ckpt = ckpt
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = mlp()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        run = (lambda x: checkpoint(self.mlp, x, use_reentrant=True)) if self.ckpt else self.mlp
        h = h + run(h)
        h = h + run(torch.tanh(3.0 * h))
        return self.head(self.norm(h))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _planned(ckpt, mlp=MLP):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LoopLM(ckpt, mlp), vocab_size=VOCAB, inputs=_tokens,
                         plan={"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})


def twice_ok():
    return _planned(True)


def twice_plain():
    return _planned(False)


def twice_scaled():
    return _planned(True, ScaledMLP)


class Block(nn.Module):
    """An MLP whose activation module is shared with the other block (one nn.GELU for the model)."""

    def __init__(self, act):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = act
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class SharedActLM(nn.Module):
    def __init__(self, ckpt=True):
        super().__init__()
        self.ckpt = ckpt
        act = nn.GELU()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block1 = Block(act)
        self.block2 = Block(act)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        run = (lambda b, x: checkpoint(b, x, use_reentrant=True)) if self.ckpt else (lambda b, x: b(x))
        h = h + run(self.block1, h)
        h = h + run(self.block2, 3.0 * h)
        return self.head(self.norm(h))


def _shared(ckpt):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=SharedActLM(ckpt), vocab_size=VOCAB, inputs=_tokens,
                         plan={"block1.up": ColwiseParallel(), "block1.down": RowwiseParallel(),
                               "block2.up": ColwiseParallel(), "block2.down": RowwiseParallel()})


def shared_act_ok():
    return _shared(True)


def shared_act_plain():
    return _shared(False)
