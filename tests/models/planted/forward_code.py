"""User-written LMs whose mistake sits in the model's OWN forward code - no submodule computes it,
so no module record judges it - each beside a twin with the mistake fixed (helper hbug4).

  head_slice / head_ok   a tied LM head done by hand with F.linear on this rank's rows of the
                         embedding, logits gathered over the ranks. The mistake: the rows are
                         taken from 0 on every rank (the rank's offset forgotten), so rank 1
                         scores the first half of the vocab again. Twin: rows from r * V / TP.
  shard_max / gather_max the logits stabilised by subtracting the row max before the gather - the
                         max of this rank's vocab SHARD, so each shard is shifted by its own
                         amount and log-softmax is no longer shift-invariant over the whole row.
                         Twin: gather first, then subtract the row's max.
  flat_pos / row_pos     learned absolute positions picked with positions counted over the whole
                         flattened batch (arange(B * S)) instead of per sequence: every sequence
                         but the first of a call gets positions past its length, so the result
                         depends on the micro-batch size. Twin: arange(S) for every row.

Run: `tpdiag compare --model py:tests/models/planted/forward_code.py:head_slice --tp 1,2
--forward-only` (flat_pos: `--tp 1 --micro-batch 2,1`). tests/test_forward_code.py.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

V, D, B, S = 64, 32, 2, 8


def world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gather_vocab(local):
    """[..., V / TP] on each rank -> [..., V], rank order (forward only)."""
    r, n = world()
    if n == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, -1)


class LM(nn.Module):
    """Embedding, one MLP block, a norm and an LM head tied to the embedding, computed here."""

    def __init__(self, mistake: str | None, pos: bool = False):
        super().__init__()
        self.mistake = mistake
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(B * S, D) * 0.02) if pos else None
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, ids):
        h = self.emb(ids)
        if self.pos is not None:
            b, s = ids.shape
            p = torch.arange(b * s).view(b, s) if self.mistake == "flat_pos" else torch.arange(s).expand(b, s)
            h = h + self.pos[p]
        h = h + self.down(F.gelu(self.up(h)))
        h = self.norm(h)
        r, n = world()
        rows = V // n
        start = 0 if self.mistake == "head_slice" else r * rows
        local = F.linear(h, self.emb.weight[start:start + rows])
        if self.mistake == "shard_max":
            return gather_vocab(local - local.amax(-1, keepdim=True))
        logits = gather_vocab(local)
        return logits - logits.amax(-1, keepdim=True)


def _tokens(g):
    return torch.randint(0, V, (B, S), generator=g)


def _target(model):
    return tpdiag.Target(model=model, plan={}, vocab_size=V, inputs=_tokens)


def head_slice():
    return _target(LM("head_slice"))


def shard_max():
    return _target(LM("shard_max"))


def head_ok():
    """The twin of head_slice and shard_max: this rank's rows, the max over the gathered row."""
    return _target(LM(None))


def flat_pos():
    return _target(LM("flat_pos", pos=True))


def row_pos():
    return _target(LM(None, pos=True))


class ResidualLM(nn.Module):
    """A DTensor-planned MLP (up column-, down row-parallel); the residual is added in the model's
    forward. The mistake: at TP > 1 the residual is added a second time (the author thought the
    row-parallel output still lacked it)."""

    def __init__(self, twice: bool):
        super().__init__()
        self.twice = twice
        self.emb = nn.Embedding(V, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        y = self.mlp(h)
        out = h + y
        if self.twice and world()[1] > 1:
            out = out + h
        return self.head(self.norm(out))


def _mlp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def residual_twice():
    return tpdiag.Target(model=ResidualLM(True), plan=_mlp_plan(), vocab_size=V, inputs=_tokens)


def residual_once():
    return tpdiag.Target(model=ResidualLM(False), plan=_mlp_plan(), vocab_size=V, inputs=_tokens)
