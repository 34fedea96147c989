"""A user's MoE with a Switch-style load-balancing loss, under sequence parallelism written by hand
(helper hplant17): the residual stream is split on the sequence from the embedding on (each rank its
S/TP positions), the router and the experts are replicated (every rank holds them whole and runs
them on its own positions; their grads summed over the ranks by hooks), the positions gathered
again before the head. The balance loss of the layer, aux = E * sum_e f_e * P_e (f_e the share of
the tokens routed to expert e, P_e the mean router probability of e), is computed by its own module
`moe.balance` and added to the cross-entropy by the user's loss (ALPHA * aux). f and P are means
over ALL the tokens of the batch. Vocab 32, hidden 16, 4 experts, seq 8.

  aux_rank_mean  the mistake (Megatron's before it reduced the token counts over the TP group):
                 each rank's aux from its OWN tokens' f and P, the ranks' aux all-reduced and
                 divided by TP - a mean of products, not the product of the means.          BUG
  aux_autograd_sum  the counts and probability sums all-reduced first (right), the sums by
                 `torch.distributed.nn.functional.all_reduce`, whose backward sums the ranks'
                 grads: each rank's loss is the same replicated value, so the balance term's grad
                 reaches the router TP times.                                           BUG
  aux_global     the twin: the token counts and the probability sums all-reduced first (identity
                 backward, as Megatron's g), one product of the whole batch's f and P on every
                 rank.                                                                  rounding
    tpdiag compare --model py:tests/models/planted/moe_aux_sp.py:aux_rank_mean --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn  # noqa: F401 (aux_autograd_sum)
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, EXPERTS, BATCH, SEQ = 32, 16, 32, 4, 2, 8
ALPHA = 0.1


def sp_rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _ScatterSeq(torch.autograd.Function):
    """This rank's positions of a replicated [B, S, D]; backward: the ranks' pieces all-gathered."""

    @staticmethod
    def forward(ctx, x):
        r, n = sp_rank_world()
        s = x.shape[1] // n
        return x[:, r * s:(r + 1) * s].contiguous()

    @staticmethod
    def backward(ctx, g):
        r, n = sp_rank_world()
        parts = [torch.empty_like(g) for _ in range(n)]
        dist.all_gather(parts, g.contiguous())
        return torch.cat(parts, 1)


class _GatherSeq(torch.autograd.Function):
    """The ranks' positions all-gathered for a replicated consumer; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, x):
        r, n = sp_rank_world()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        r, n = sp_rank_world()
        s = g.shape[1] // n
        return g[:, r * s:(r + 1) * s].contiguous()


class _SumReplicated(torch.autograd.Function):
    """The ranks' values summed for a consumer every rank runs alike (Megatron's g): backward the
    identity - each rank's share gets the one replicated loss's grad, once."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def _grads_summed(module):
    def hook(g):
        if sp_rank_world()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g
    for p in module.parameters():
        p.register_hook(hook)


class BalanceLoss(nn.Module):
    """Switch Transformer's load-balancing loss from the router's probabilities and top-1 choice."""

    def __init__(self, combine):
        super().__init__()
        self.combine = combine

    def forward(self, probs, choice):
        n = sp_rank_world()[1]
        counts = F.one_hot(choice, EXPERTS).to(probs.dtype).sum((0, 1))  # tokens per expert
        psum = probs.sum((0, 1))
        tokens = torch.tensor(float(choice.numel()), dtype=probs.dtype)
        if self.combine == "rank_mean":
            aux = EXPERTS * ((counts / tokens) * (psum / tokens)).sum()
            if n > 1:
                aux = _SumReplicated.apply(aux) / n
            return aux
        if n > 1:
            counts = _SumReplicated.apply(counts)
            # torch's autograd all_reduce sums the ranks' grads in backward: right where each rank's
            # loss were its own share, TP times too much for this replicated loss
            psum = dist_fn.all_reduce(psum) if self.combine == "autograd_sum" else _SumReplicated.apply(psum)
            tokens = tokens * n
        return EXPERTS * ((counts / tokens) * (psum / tokens)).sum()


class MoE(nn.Module):
    def __init__(self, combine):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, FF, DIM) / DIM ** 0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, DIM, FF) / FF ** 0.5)
        self.balance = BalanceLoss(combine)
        _grads_summed(self)
        self.aux = None

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            sel = choice == e
            h = F.gelu(x[sel] @ self.w_in[e].t()) @ self.w_out[e].t()
            out[sel] = h * weight[sel, None]
        self.aux = self.balance(probs, choice)
        return x + out


class AuxLM(nn.Module):
    def __init__(self, combine):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = MoE(combine)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        if sp_rank_world()[1] > 1:
            h = _ScatterSeq.apply(h)
        h = self.moe(h)
        if sp_rank_world()[1] > 1:
            h = _GatherSeq.apply(h)
        return self.head(self.norm(h))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(combine):
    model = AuxLM(combine)

    def loss(logits, labels):
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return ce + ALPHA * model.moe.aux

    return tpdiag.Target(model=model, plan={}, vocab_size=VOCAB, inputs=_tokens, loss=loss)


def aux_rank_mean():
    return _target("rank_mean")


def aux_autograd_sum():
    return _target("autograd_sum")


def aux_global():
    return _target("global")
