"""A user's small dense LM with a hand-written sequence-parallel block: layer 0 is an MLP the plan splits
(column-parallel up, row-parallel down: its all-reduce rounds otherwise than TP=1), layer 1 runs its MLP
on each rank's own slice of the positions at TP > 1 and all-gathers the slices back. The sequence is 5
positions long, which TP=2 does not divide. No router, no mask, no value-dependent shape anywhere.
A parallel-residual variant (GPT-J style: both blocks read the same embedding) has layer 1's input
bitwise TP=1's although layer 0's output differs beside it.

  chunks_ok()     slices of ceil(S/TP) positions: the sequence is padded to TP slices and the padding
                  cut after the gather                                                    correct
  chunks_floor()  slices of S // TP positions: the last S % TP positions are never computed and zeros
                  stand in for them after the gather - the ranks' MLP inputs hold 4 of the 5 positions
                  (a real shape bug, behind layer 0's rounding)
  parallel_ok(), parallel_floor()   the same two blocks, parallel residual

    tpdiag compare --model py:tests/models/planted/seq_chunks.py:chunks_floor --tp 1,2 --dtype bfloat16
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN, B, S = 32, 32, 64, 2, 5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _gather_positions(y):
    """Every rank's slice of positions, in rank order, on every rank (autograd-aware)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(y.contiguous(), gather_dim=1, group=dist.group.WORLD)


class SeqParallelBlock(nn.Module):
    def __init__(self, floor):
        super().__init__()
        self.floor = floor
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x):
        h = self.norm(x)
        n = dist.get_world_size() if dist.is_initialized() else 1
        if n == 1:
            return self.mlp(h)
        s = h.shape[1]
        c = s // n if self.floor else -(-s // n)
        if c * n > s:
            h = F.pad(h, (0, 0, 0, c * n - s))
        r = dist.get_rank()
        y = _gather_positions(self.mlp(h[:, r * c:(r + 1) * c]))
        return y[:, :s] if c * n >= s else F.pad(y, (0, 0, 0, s - c * n))


class LM(nn.Module):
    def __init__(self, floor, parallel=False):
        super().__init__()
        self.parallel = parallel
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp0 = MLP()
        self.block1 = SeqParallelBlock(floor)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.parallel:
            h = h + self.mlp0(h) + self.block1(h)
        else:
            h = h + self.mlp0(h)
            h = h + self.block1(h)
        return self.head(self.norm(h))


def _target(floor, parallel=False):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(7)
    return tpdiag.Target(model=LM(floor, parallel), plan={"mlp0.up": ColwiseParallel(), "mlp0.down": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=lambda g: torch.randint(0, VOCAB, (B, S), generator=g))


def chunks_ok():
    return _target(False)


def chunks_floor():
    return _target(True)


def parallel_ok():
    return _target(False, parallel=True)


def parallel_floor():
    return _target(True, parallel=True)
