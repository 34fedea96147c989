"""A replicated top-2 MoE block whose residual add is inside the block (helper hreview18): every rank
runs every expert on every token (no expert parallelism, the router out of the plan), the MLP before
it split by a plan. The router is freshly initialised small (scores near ties) and the experts' share
of the block's output is small next to the residual it carries, so a top-2 choice made otherwise
moves the block's output row by a few percent only. Correct at every degree.

  resid_ok()       the block as described                                           rounding
  resid_router_f() the mistake: the router's scores go through Megatron's f (identity forward,
                   all-reduce backward) as if the router were split - it is replicated, so its
                   output grad, whole on every rank, is summed over the ranks: TP x  not rounding

    tpdiag compare --model py:tests/models/planted/moe_resid.py:resid_ok --tp 1,2 --dtype bfloat16
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, EXPERTS, FFN, K, B, S = 32, 32, 4, 64, 2, 4, 16


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class MoE(nn.Module):
    def __init__(self, scale, router_f=False):
        super().__init__()
        self.router_f = router_f
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        nn.init.normal_(self.router.weight, std=1e-3)  # a fresh router: its scores near ties
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) / DIM ** 0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * scale / FFN ** 0.5)

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        scores = self.router(t)
        if self.router_f and dist.is_initialized() and dist.get_world_size() > 1:
            scores = _Copy.apply(scores)
        w, idx = scores.softmax(-1).topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(t)
        for e in range(EXPERTS):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                h = F.gelu(t[tok] @ self.w_in[e]) @ self.w_out[e]
                out = out.index_add(0, tok, h * w[tok, slot, None])
        return x + out.reshape(x.shape)


class LM(nn.Module):
    def __init__(self, scale, router_f=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)
        self.moe = MoE(scale, router_f)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(self.moe(h)))


def _target(scale, router_f=False):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LM(scale, router_f), plan={"up": ColwiseParallel(), "down": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=lambda g: torch.randint(0, VOCAB, (B, S), generator=g))


def resid_ok():
    return _target(0.1)


def resid_router_f():
    return _target(0.1, router_f=True)
