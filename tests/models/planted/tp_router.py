"""An MoE whose plan catches its router (helper hbug7): the experts are replicated (each rank runs
every expert on every token, no expert parallelism), the MLPs around them are split by a plan. The
mistake: a wildcard meant for the experts' projections also makes the ROUTER `ColwiseParallel()`
(torch's default local output), so each rank's router logits are its half of the experts; the
softmax and top-1 run over that half and its local ids index the replicated experts - every rank
routes among the first experts only, each by other scores. Twin: the router left out of the plan.

    tpdiag compare --model py:tests/models/planted/tp_router.py:router_split --tp 1,2
tests/test_tp_gathers.py; docs/planted.md has the verdicts.
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, EXPERTS, FFN, B, S = 32, 32, 4, 64, 2, 8


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * 0.1)

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        probs = self.router(t).softmax(-1)
        weight, expert = probs.max(-1)
        out = torch.zeros_like(t)
        for e in range(EXPERTS):
            idx = (expert == e).nonzero().flatten()
            if idx.numel():
                out[idx] = (F.gelu(t[idx] @ self.w_in[e]) @ self.w_out[e]) * weight[idx, None]
        return out.reshape(x.shape)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)
        self.moe = MoE()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(h)))
        h = h + self.moe(h)
        return self.head(self.norm(h))


def _target(router_planned):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if router_planned:  # the mistake: the router split with the projections
        plan["moe.router"] = ColwiseParallel()
    return tpdiag.Target(model=LM(), plan=plan, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (B, S), generator=g))


def router_split():
    return _target(True)


def router_ok():
    return _target(False)
