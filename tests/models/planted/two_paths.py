"""An activation whose grad leaves by two paths, one of them no module (helper hbug14): a gated
residual stream `h = h * sigmoid(gate(h))` written in the model's forward - h is read by the `gate`
module AND by the plain multiply - behind a hand-written TP MLP block whose row-parallel all-reduce
is the first divergence (rounding). h's grad is the sum of gate's input grad and the grad through
the multiply, which no record holds. Vocab 32, dim 32, ff 64.

  gate_ok      correct at every TP                                                   rounding
  gate_f       gate's input goes through Megatron's f (its grad all-reduced) although gate is
               replicated: gate's part of h's grad is TP times at TP > 1             BUG

  pair_ok      correct, inside a stage that returns two tensors (its gate's logits too)  rounding
  pair_f       gate_f's mistake inside that stage: no float64 backward of the stage, so h's grad is
               judged by the root's (the next ancestor that runs once, one output)     BUG

  pair_drop_ok pair_ok with dropout on the embeddings (GPT-2's embd_pdrop): the root's float64
               re-execution is refused (it draws random numbers), so h's grad is not judged;
               rounding moves it by little                                            rounding
  pair_drop_f  pair_f with that dropout: not judged, and moved by a quarter            not judged

    tpdiag compare --model py:tests/models/planted/two_paths.py:gate_f --tp 1,2
tests/test_two_paths.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 32, 64, 2, 8


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Copy(torch.autograd.Function):
    """Megatron's f: the input as is, its grad all-reduced over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, y):
        y = y.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


def copy(x):
    return _Copy.apply(x) if rank_world()[1] > 1 else x


def reduce(y):
    return _Reduce.apply(y) if rank_world()[1] > 1 else y


def sum_grad(p):
    """each rank holds the whole parameter and uses its slice: the grads summed over the ranks"""
    if rank_world()[1] > 1:
        p.register_hook(lambda g: _summed(g))


def _summed(g):
    g = g.clone()
    dist.all_reduce(g)
    return g


class Block(nn.Module):
    """up column-parallel (its rows of the weight), down row-parallel (its columns), hand-written."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(FF, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(DIM, FF) / FF ** 0.5)
        sum_grad(self.up)
        sum_grad(self.down)

    def forward(self, x):
        r, n = rank_world()
        rows = slice(r * FF // n, (r + 1) * FF // n)
        h = F.gelu(copy(x) @ self.up[rows].t())
        return reduce(h @ self.down[:, rows].t())


class Gate(nn.Module):
    def __init__(self, through_f: bool):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.through_f = through_f

    def forward(self, h):
        # the mistake: Megatron's f in front of a REPLICATED layer - each rank's whole grad summed
        return self.proj(copy(h) if self.through_f else h)


class TwoPathLM(nn.Module):
    def __init__(self, through_f=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.gate = Gate(through_f)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        e = self.embed(tokens)
        h = e + self.block(e)
        h = h * torch.sigmoid(self.gate(h))  # h read by the gate module and by this multiply
        return self.head(self.norm(h))


class Stage(nn.Module):
    """the residual block and its gate as one stage, which also returns the gate's logits (for the
    user's logging): two outputs, so no float64 backward of the stage is formed"""

    def __init__(self, through_f: bool):
        super().__init__()
        self.block = Block()
        self.gate = Gate(through_f)

    def forward(self, h):
        h = h + self.block(h)
        g = self.gate(h)
        return h * torch.sigmoid(g), g


class PairLM(nn.Module):
    def __init__(self, through_f=False, embed_drop=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        # GPT-2's embd_pdrop: the same mask at every rank and degree (one seed, a replicated input)
        self.drop = nn.Dropout(embed_drop)
        self.stage = Stage(through_f)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h, _ = self.stage(self.drop(self.embed(tokens)))
        return self.head(self.norm(h))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def gate_ok():
    return tpdiag.Target(model=TwoPathLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def gate_f():
    return tpdiag.Target(model=TwoPathLM(through_f=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def pair_ok():
    return tpdiag.Target(model=PairLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def pair_f():
    return tpdiag.Target(model=PairLM(through_f=True), plan={}, vocab_size=VOCAB, inputs=_tokens)


def pair_drop_f():
    return tpdiag.Target(model=PairLM(through_f=True, embed_drop=0.1), plan={}, vocab_size=VOCAB, inputs=_tokens)


def pair_drop_ok():
    return tpdiag.Target(model=PairLM(embed_drop=0.1), plan={}, vocab_size=VOCAB, inputs=_tokens)
