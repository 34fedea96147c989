"""A NormFormer-style norm on the FFN's hidden activations, written the way a first TP port writes
it (helper hnew17). After column-parallel w1/w3 each rank holds its own columns of the hidden h:
`local` normalises them alone, `F.rms_norm(h, h.shape[-1:])` - a wrong result at TP=2; `global`
sums the squares over the ranks with a differentiable all-reduce before the rsqrt - the same
function, its partial sums added in another order at the all-reduce; `global_nograd` sums them
with `dist.all_reduce` in place, which autograd passes over: its forward is right, its backward
leaves out the other ranks' share of the norm's grad."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN = 64, 32, 64


class FeedForward(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        h = F.silu(self.w1(x)) * self.w3(x)
        if self.how == "local":
            h = F.rms_norm(h, h.shape[-1:], eps=1e-6)  # over this rank's columns only at TP > 1
        else:
            ss = h.pow(2).sum(-1, keepdim=True)
            if dist.is_initialized() and dist.get_world_size() > 1:
                if self.how == "global":
                    import torch.distributed.nn.functional as dfn

                    ss = dfn.all_reduce(ss)
                else:
                    dist.all_reduce(ss)
            h = h * torch.rsqrt(ss / FFN + 1e-6)
        return self.w2(h)


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


def local():
    return tpdiag.Target(model=Model("local"), plan=_plan(), vocab_size=VOCAB)


def global_():
    return tpdiag.Target(model=Model("global"), plan=_plan(), vocab_size=VOCAB)


def global_nograd():
    return tpdiag.Target(model=Model("global_nograd"), plan=_plan(), vocab_size=VOCAB)
