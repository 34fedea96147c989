"""A user's expert-parallel MoE written with plain torch.distributed: rank r holds experts
[r*E/n, (r+1)*E/n) and runs only the tokens routed to them, so the ranks' op streams differ (other
shapes per rank: the second pass's op level cannot record them and falls back to module level,
RUN_DIR/ops-modules). Top-3 of 4 experts: a token whose experts sit on both ranks adds them in
another order at TP=2 - rounding for the second pass to judge. Run forward-only (in-place
collectives)."""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, EXPERTS, TOP, BATCH, SEQ = 64, 32, 32, 4, 3, 2, 8


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class EPMoE(nn.Module):
    """The experts are this module's own weights, run functionally: its output has the same
    shape on every rank (module records agree), the ops inside it do not."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, x):
        r, n = _rank_world()
        flat = x.reshape(-1, DIM)
        gate, choice = torch.softmax(self.router(flat), -1).topk(TOP, -1)
        out = torch.zeros_like(flat)
        per = EXPERTS // n
        for e in range(r * per, (r + 1) * per):
            tok, slot = (choice == e).nonzero(as_tuple=True)
            if tok.numel():
                y = torch.relu(flat[tok] @ self.up[e].t()) @ self.down[e].t()
                out.index_add_(0, tok, y * gate[tok, slot, None])
        if n > 1:
            # a token's experts are summed in expert order on one rank and across ranks by the
            # all-reduce at TP>1: a + (b + c) where TP=1 adds (a + b) + c - rounding, not a bug
            dist.all_reduce(out)
        return out.reshape(x.shape)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = EPMoE()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.head(h + self.moe(h))


def target():
    return tpdiag.Target(model=LM(), plan={}, vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
