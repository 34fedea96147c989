"""A SwiGLU MLP with one fused gate/up projection (`gate_up`, 2 x FF rows), split by a DTensor plan
(`gate_up` `ColwiseParallel()`, `down` `RowwiseParallel()`, torch's default local outputs) - helper
hbug12. Vocab 32, hidden 32, ffn 64.

  swiglu_chunk       `gate, up = gate_up(x).chunk(2, -1)`: the rows are [all gate; all up], so at
                     TP=2 rank 0's shard is gate only and rank 1's up only, and each rank's chunk
                     pairs two halves of one of them. Right at TP=1 only.
  swiglu_interleave  the twin: the rows interleaved (gate, up, gate, up, ...) and split with
                     `[..., 0::2]` / `[..., 1::2]` - every contiguous row shard holds matching
                     gate and up rows. The same weights, another meaning; right at any degree.

    tpdiag compare --model py:tests/models/planted/swiglu_fused.py:swiglu_chunk --tp 1,2
tests/test_swiglu_fused.py.
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FF, BATCH, SEQ = 32, 32, 64, 2, 8


class SwiGLU(nn.Module):
    def __init__(self, interleaved):
        super().__init__()
        self.gate_up = nn.Linear(DIM, 2 * FF, bias=False)
        self.down = nn.Linear(FF, DIM, bias=False)
        self.interleaved = interleaved

    def forward(self, x):
        h = self.gate_up(x)
        # the mistake (not interleaved): halves of the LOCAL shard, not of the fused rows
        gate, up = (h[..., 0::2], h[..., 1::2]) if self.interleaved else h.chunk(2, -1)
        return self.down(F.silu(gate) * up)


class LM(nn.Module):
    def __init__(self, interleaved):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = SwiGLU(interleaved)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.mlp(h)))


def _target(interleaved):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LM(interleaved), plan={"mlp.gate_up": ColwiseParallel(), "mlp.down": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def swiglu_chunk():
    return _target(False)


def swiglu_interleave():
    return _target(True)
