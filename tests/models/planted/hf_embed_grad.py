"""A causal LM laid out as transformers lays one out (helper hname18): `ForCausalLM` holds its body as
a child named `model` (embed_tokens, layers, norm) and its `lm_head`; the body scales the embeddings
in its own code (Gemma's sqrt(hidden) normalizer) before the layers and adds them back after each
layer through a per-channel gate. Each layer's MLP is split by a
DTensor plan (`up_proj` ColwiseParallel, `down_proj` RowwiseParallel). Vocab 32, hidden 32.

  embed_grad_twice  the user put Megatron's `f` (copy to the TP region: identity forward, all-reduce
                    backward) on the scaled embeddings, a habit from hand-written Megatron layers -
                    but the plan's ColwiseParallel already hands back the whole input grad on every
                    rank, so the grad of the embeddings is summed over the ranks once more: TP times
                    what it should be. The forward is right, every rank agrees, and Adam's update
                    barely moves with the grad's scale: only the embeddings' output grad shows it.
  embed_grad_ok     the twin: no `f`.

    tpdiag compare --model py:tests/models/planted/hf_embed_grad.py:embed_grad_twice --tp 1,2
"""
import math

import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, HIDDEN, FFN, LAYERS, BATCH, SEQ = 32, 32, 64, 2, 2, 8


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce (sum) of the grad backward."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


def copy_to_tp_region(t):
    return _CopyToRegion.apply(t) if dist.is_initialized() and dist.get_world_size() > 1 else t


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, h):
        return h + self.mlp(self.input_layernorm(h))


class Model(nn.Module):
    def __init__(self, reduce_again):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        # the embeddings added back after every layer, each channel by a learned gate (modded-nanogpt's
        # x0 skip, CaiT's per-channel scale)
        self.x0_gate = nn.Parameter(torch.linspace(1.5, 3.5, HIDDEN))
        self.reduce_again = reduce_again

    def forward(self, input_ids):
        e = self.embed_tokens(input_ids) * math.sqrt(HIDDEN)
        # the mistake: the plan's ColwiseParallel reduces this grad already
        h = copy_to_tp_region(e) if self.reduce_again else e
        for layer in self.layers:
            h = layer(h) + self.x0_gate * e
        return self.norm(h)


class ForCausalLM(nn.Module):
    def __init__(self, reduce_again):
        super().__init__()
        self.model = Model(reduce_again)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}


def _target(reduce_again):
    return tpdiag.Target(model=ForCausalLM(reduce_again), plan=_plan(), vocab_size=VOCAB,
                         inputs=lambda g: torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def embed_grad_twice():
    return _target(True)


def embed_grad_ok():
    return _target(False)
