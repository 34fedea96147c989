"""A user's replicated top-1 MoE written the way tutorials write it: the experts are modules of their
own (`nn.ModuleList` of MLPs) and the block calls each on the tokens routed to it, `experts[e](t[tok])`
- so each expert's records are as long as its token count, a count the router's scores decide. The MLP
before it is split by a plan (its row-parallel all-reduce rounds otherwise than TP=1), and the router is
freshly initialised small (its scores near ties): at TP=2 a top-1 choice may flip, an expert then runs
on fewer tokens than at TP=1 (none at all where it had one) - a shape that rounding changed. Correct
at every degree.

  calls_ok()     the block as described                               no sharding bug (router flips)
  calls_split()  the mistake: at TP > 1 each expert runs on its first 1/TP of its tokens only (as if
                 another rank ran the rest) and the others pass through - a shape a bug changed

    tpdiag compare --model py:tests/models/planted/moe_expert_calls.py:calls_ok --tp 1,2 --dtype bfloat16
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, EXPERTS, FFN, B, S = 32, 32, 8, 64, 2, 4


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self, split):
        super().__init__()
        self.split = split
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        nn.init.normal_(self.router.weight, std=0.01)  # a fresh router: its scores near ties
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        probs = self.router(t).softmax(-1)
        w, idx = probs.max(-1)
        out = torch.zeros_like(t)
        n = dist.get_world_size() if dist.is_initialized() else 1
        for e, expert in enumerate(self.experts):
            tok = (idx == e).nonzero().flatten()
            if self.split and n > 1:
                tok = tok[: tok.numel() // n]
            out = out.index_add(0, tok, expert(t[tok]) * w[tok, None])
        return x + out.reshape(x.shape)


class LM(nn.Module):
    def __init__(self, split):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)
        self.moe = MoE(split)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(self.moe(h)))


def _target(split):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(54)  # at TP=2 a token of expert 3 (its only one) flips to expert 6
    return tpdiag.Target(model=LM(split), plan={"up": ColwiseParallel(), "down": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=lambda g: torch.randint(0, VOCAB, (B, S), generator=g))


def calls_ok():
    return _target(False)


def calls_split():
    return _target(True)
