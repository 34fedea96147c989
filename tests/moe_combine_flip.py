"""A user's bf16 top-2 MoE whose experts are split over the TP ranks by hand, behind a row-parallel
projection. The projection's all-reduce moves the router's input by a rounding at TP=2, and one
token's router scores nearly tie right there: that token picks another expert at TP=2 (router-flip,
rounding). The bug sits in the MoE's own COMBINE step, inside the same module as the flip:

  combine_ok()         CORRECT: the top-2 gates renormalised over the token's two experts, on every rank
  combine_local_bug()  the twin: each rank renormalises the gates over the experts IT holds, so a token
                       whose two experts sit on two ranks gets weights (1, 1) instead of (p, 1 - p) at TP=2
                       (TP=1 holds every expert: the same numbers as combine_ok there)

    tpdiag compare --model py:tests/moe_combine_flip.py:combine_local_bug --tp 1,2 --dtype bfloat16 --forward-only
On 958380df the twin's MoE output (its float64 re-execution makes the router's unclear top-2 inside) read
`router-flip` - it comes after the flip - the run `rounding only`, gate --allow rounding exit 0
(tests/test_moe_combine_flip.py).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN, EXPERTS, TOP = 64, 32, 64, 4, 2
BATCH, SEQ = 2, 8


def rank_and_size():
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class AllReduce(torch.autograd.Function):
    """mode "out": the ranks' partial outputs summed (their grad is every rank's already);
    mode "in": a replicated input entering sharded work (its grad is the sum of the ranks' parts)."""

    @staticmethod
    def forward(ctx, t, mode):
        ctx.mode = mode
        if mode == "out":
            t = t.clone()
            dist.all_reduce(t)
            return t
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        if ctx.mode == "in":
            g = g.clone()
            dist.all_reduce(g)
        return g, None


def _grad_of_every_rank(g):
    if rank_and_size()[1] == 1:
        return g
    g = g.clone()
    dist.all_reduce(g)
    return g


class RowParallelProj(nn.Module):
    """x + x W^T with W's input features split over the ranks."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.weight.register_hook(_grad_of_every_rank)

    def part(self, x, rank, size):
        cols = slice(rank * DIM // size, (rank + 1) * DIM // size)
        return x[:, cols] @ self.weight[:, cols].t()

    def forward(self, x):
        rank, size = rank_and_size()
        if size == 1:
            return x + self.part(x, 0, 1)
        return x + AllReduce.apply(self.part(AllReduce.apply(x, "in"), rank, size), "out")


class TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(DIM, EXPERTS)

    def forward(self, x):
        logits = self.score(x)
        return logits, logits.topk(TOP, dim=-1).indices


class SparseMoE(nn.Module):
    def __init__(self, local_renorm=False):
        super().__init__()
        self.router = TopKRouter()
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN ** 0.5)
        self.local_renorm = local_renorm
        for p in (*self.router.parameters(), self.up, self.down):
            p.register_hook(_grad_of_every_rank)  # a rank's grad covers its own experts' tokens

    def forward(self, x):
        rank, size = rank_and_size()
        mine = range(rank * EXPERTS // size, (rank + 1) * EXPERTS // size)
        h = AllReduce.apply(x, "in") if size > 1 else x
        logits, chosen = self.router(h)
        gates = logits.softmax(-1).gather(-1, chosen)
        if self.local_renorm:
            # the mistake: the gates renormalised over this rank's experts only
            held = (chosen >= mine.start) & (chosen < mine.stop)
            gates = gates * held
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(1e-9)
        else:
            gates = gates / gates.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in mine:
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            y = F.silu(h[tok] @ self.up[e].t()) @ self.down[e].t()
            out = out.index_add(0, tok, y * gates[tok, slot, None])
        if size > 1:
            out = AllReduce.apply(out, "out")
        return x + out


class Net(nn.Module):
    def __init__(self, local_renorm):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = RowParallelProj()
        self.moe = SparseMoE(local_renorm)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens).reshape(-1, DIM)
        x = self.norm(self.moe(self.proj(x)))
        return self.head(x).reshape(*tokens.shape, VOCAB)


def batch(_generator):
    return (torch.arange(BATCH * SEQ) * 5 % VOCAB).reshape(BATCH, SEQ)


def near_tie(net: Net) -> None:
    """The router made to tie for one token between TP=1 and TP=2: in bf16, as the ranks compute it,
    find the router input element the all-reduce moves most, and let expert 1 score that feature
    while expert 0 scores a constant strictly between its TP=1 and TP=2 values; expert 2 always
    first, expert 3 always last, so the second place is the contest."""
    bf = torch.bfloat16
    with torch.no_grad():
        x = net.embed.weight.to(bf)[batch(None)].reshape(-1, DIM)
        w = net.proj.weight.to(bf)
        one = x + x @ w.t()
        two = x + (x[:, :DIM // 2] @ w[:, :DIM // 2].t() + x[:, DIM // 2:] @ w[:, DIM // 2:].t())
        mid = ((one.float() + two.float()) / 2).to(bf)
        room = (mid > torch.minimum(one, two)) & (mid < torch.maximum(one, two))  # a bf16 value between
        if not bool(room.any()):
            raise RuntimeError("the all-reduce moved no router input enough to tie: change the sizes")
        moved = (one.float() - two.float()).abs() / one.float().abs().clamp_min(1e-30)
        tok, j = divmod(int(moved.masked_fill(~room, -1).flatten().argmax()), DIM)
        between = mid[tok, j]
        seen = torch.cat([one[:, j], two[:, j]]).float()
        s = net.moe.router.score
        s.weight.zero_()
        s.weight[1, j] = 1.0
        s.bias.copy_(torch.tensor([float(between), 0.0, float(seen.max()) + 1.0, float(seen.min()) - 10.0]))


def _target(local_renorm):
    net = Net(local_renorm)
    near_tie(net)
    return tpdiag.Target(model=net, plan={}, vocab_size=VOCAB, inputs=batch)


def combine_ok():
    return _target(False)


def combine_local_bug():
    return _target(True)
