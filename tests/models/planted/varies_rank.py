"""A per-rank buffer nobody reads, beside a kernel whose result varies per rank (helper hbug14).
On a GPU a nondeterministic kernel (atomics: a scatter-add combine, a split-K reduction) gives
each rank other last bits on the same inputs; on the CPU this is simulated by a reduction whose
order depends on the rank. A `Combine` module (no parameters, after a frozen embedding) adds a
small term summed in the rank's own order; an `Observer` keeps a running statistic of the
activations in a BUFFER, summed in the rank's own order too, kept for the logs (never read).
Vocab 32, dim 32; run with --steps 2.

  logged_varies   the observer's buffer unread; Combine varies per rank at every step: the
                  buffer's verdict is unknown (not shown read), not a BUG of its own
  read_beside     the same, and a `Scale` module given the observer (before the combine: its
                  input the same on every rank) multiplies its input by 100 x that mean:
                  step 1 reads the buffer, Scale's output differs across ranks there   BUG

    tpdiag compare --model py:tests/models/planted/varies_rank.py:logged_varies --tp 1,2 --steps 2
tests/test_varies_rank.py
"""
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def rank_order_sum(t: torch.Tensor) -> torch.Tensor:
    """sum over the last dim in an order of the rank's own (the atomics' order on a GPU)"""
    g = torch.Generator().manual_seed(1000 + rank())
    perm = torch.randperm(t.shape[-1], generator=g)
    acc = torch.zeros_like(t[..., 0])
    for j in perm.tolist():
        acc = acc + t[..., j]
    return acc


class Combine(nn.Module):
    def forward(self, x):
        return x + 1e-3 * rank_order_sum(x).unsqueeze(-1)


class Observer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("stat", torch.full((), 0.01))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.stat.copy_(rank_order_sum(x.detach().flatten()) / x.numel())
        return x


class Scale(nn.Module):
    def __init__(self, observer):
        super().__init__()
        self.observer = [observer]  # given, not a submodule

    def forward(self, x):
        return x * (100 * self.observer[0].stat)  # a data-dependent gain


class VariesLM(nn.Module):
    def __init__(self, read_beside=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.weight.requires_grad_(False)  # frozen: the combine's input is the same on every rank
        self.combine = Combine()
        self.observer = Observer()
        self.scale = Scale(self.observer) if read_beside else None
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.scale is not None:
            h = self.scale(h)  # before the combine: its input the same on every rank
        return self.head(self.observer(self.combine(h)))


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def logged_varies():
    return tpdiag.Target(model=VariesLM(), plan={}, vocab_size=VOCAB, inputs=_tokens)


def read_beside():
    return tpdiag.Target(model=VariesLM(read_beside=True), plan={}, vocab_size=VOCAB, inputs=_tokens)
