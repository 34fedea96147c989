"""A NormFormer-style RMSNorm on the FFN's hidden activations, split over the TP ranks and written by
hand (helper hplant18): after column-parallel w1/w3 (a DTensor plan) each rank holds its own columns
of the hidden h, and its own `HiddenNorm` module sums the squares over the ranks with a
differentiable all-reduce before the rsqrt. Where the epsilon goes is the mistake. Vocab 64, dim 32,
ffn 64.

  eps_each_rank  each rank adds eps to ITS mean before the all-reduce (`ss / FFN + EPS`, then the
                 sum): the ranks' epsilons add up, eps * TP. A small wrong term - the hidden's mean
                 square moves by (TP - 1) * eps - but a wrong function at TP > 1.       BUG
  eps_once       eps added once, after the all-reduce.                                  rounding
  mean_of_means  each rank's mean over its own columns, all-reduced with AVG, then eps: the same
                 function for equal shards, another order of the sum.                   rounding

    tpdiag compare --model py:tests/models/planted/norm_eps.py:eps_each_rank --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN = 64, 32, 64
EPS = 1e-6


def world():
    return dist.get_world_size() if dist.is_initialized() else 1


class HiddenNorm(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, h):
        import torch.distributed.nn.functional as dfn

        n = world()
        if self.how == "eps_each_rank":
            ms = h.pow(2).sum(-1, keepdim=True) / FFN + EPS
            ms = dfn.all_reduce(ms) if n > 1 else ms
        elif self.how == "mean_of_means":
            ms = h.pow(2).mean(-1, keepdim=True)
            ms = (dfn.all_reduce(ms) / n if n > 1 else ms) + EPS
        else:
            ss = h.pow(2).sum(-1, keepdim=True)
            ms = (dfn.all_reduce(ss) if n > 1 else ss) / FFN + EPS
        return h * torch.rsqrt(ms)


class FeedForward(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.hidden_norm = HiddenNorm(how)

    def forward(self, x):
        return self.w2(self.hidden_norm(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward(how)

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layer = Block(how)
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.output(self.norm(self.layer(self.tok_embeddings(tokens))))


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layer.feed_forward.w1": ColwiseParallel(), "layer.feed_forward.w3": ColwiseParallel(),
            "layer.feed_forward.w2": RowwiseParallel()}


def _target(how):
    return tpdiag.Target(model=Model(how), plan=_plan(), vocab_size=VOCAB)


def eps_each_rank():
    return _target("eps_each_rank")


def eps_once():
    return _target("eps_once")


def mean_of_means():
    return _target("mean_of_means")
