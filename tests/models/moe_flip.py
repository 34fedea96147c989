"""A tiny MoE whose router nearly ties for one token, right where TP=2's row-parallel reduction
moves the router's input by a few ULP: the expert choice flips at TP=2 (router-flip).

up (column-parallel) -> gelu -> down (row-parallel, the planted reordered sum) -> residual h ->
router (top-2 of 4) -> experts (replicated, dense) -> head. The router reads one feature j of h:
expert 0 scores h[t, j], expert 1 a constant m that `target` places strictly between TP=1's and
TP=2's value of h[t, j] for one token t (computed here, before any sharding, from the same
weights and batch: the TP=2 value is the two rank partial sums added, as gloo adds them).
Expert 2 always wins (by ~1), expert 3 always loses: the second place is the contest.
`target_wide` moves m far from every token's h[:, j]: the same reduction, no flip.
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, HID, E, K = 64, 32, 64, 4, 2
BATCH, SEQ = 2, 8


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, E)

    def forward(self, h):
        logits = self.proj(h)
        top, idx = logits.topk(K, dim=-1)
        return logits, top.softmax(-1), idx


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, DIM, DIM) / DIM ** 0.5)

    def forward(self, h, idx, weights):
        y = torch.tanh(torch.einsum("bsd,edf->bsef", h, self.w))          # every expert, dense
        picked = y.gather(2, idx.unsqueeze(-1).expand(*idx.shape, DIM))  # [b, s, K, DIM]
        return (picked * weights.unsqueeze(-1)).sum(2)


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HID)
        self.down = nn.Linear(HID, DIM, bias=False)
        self.router = Router()
        self.experts = Experts()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def trunk(self, ids):
        x = self.embed(ids)
        return x, F.gelu(self.up(x))

    def forward(self, input_ids):
        x, a = self.trunk(input_ids)
        h = x + self.down(a)
        _, w, idx = self.router(h)
        return self.head(h + self.experts(h, idx, w))


def inputs(g: torch.Generator) -> dict:
    ids = torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) * 7 % VOCAB  # fixed: m is set for it
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return {"input_ids": ids, "labels": labels}


def _h_both(model: TinyMoE):
    """h at TP=1 and at TP=2 (rank partials of `down`, each a GEMM of its half of HID)."""
    with torch.no_grad():
        x, a = model.trunk(inputs(None)["input_ids"])
        w = model.down.weight
        h1 = x + F.linear(a, w)
        half = HID // 2
        p0 = F.linear(a[..., :half].contiguous(), w[:, :half].contiguous())
        p1 = F.linear(a[..., half:].contiguous(), w[:, half:].contiguous())
        return h1, x + (p0 + p1)


def _set_router(model: TinyMoE, j: int, m: float, hj: torch.Tensor) -> None:
    # expert 2 wins by ~1 (not by 100: the second expert's weight must matter, so the flipped
    # token's output moves far beyond a rounding bound), expert 3 always last
    top, bottom = float(hj.max()) + 1.0, float(hj.min()) - 10.0
    with torch.no_grad():
        model.router.proj.weight.zero_()
        model.router.proj.weight[0, j] = 1.0
        model.router.proj.bias.copy_(torch.tensor([0.0, m, top, bottom]))


def _build(wide: bool) -> tpdiag.Target:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = TinyMoE()
    h1, h2 = _h_both(model)
    ulp = (h1.view(torch.int32).long() - h2.view(torch.int32).long()).abs()
    ulp[(h1.sign() != h2.sign())] = 0
    flat = int(ulp.flatten().argmax())
    if int(ulp.flatten()[flat]) < 2:
        raise RuntimeError("no element of h moved by >= 2 ULP at TP=2: change the seed or sizes")
    b, s, j = torch.unravel_index(torch.tensor(flat), h1.shape)
    lo, hi = sorted((float(h1[b, s, j]), float(h2[b, s, j])))
    m = (lo + hi) / 2 if not wide else float(h1[..., j].min()) - 1.0
    _set_router(model, int(j), float(torch.tensor(m, dtype=torch.float32)), torch.cat([h1[..., j], h2[..., j]]))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return tpdiag.Target(model=model, plan=plan, vocab_size=VOCAB, inputs=inputs,
                         divisors={"hidden": HID})


def target() -> tpdiag.Target:
    return _build(wide=False)


def target_wide() -> tpdiag.Target:
    return _build(wide=True)
