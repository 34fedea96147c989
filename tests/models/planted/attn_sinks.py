"""A user's gpt-oss-style attention with learned attention SINKS, HF-style modules split by a
torchtitan-style DTensor plan (helper hplant17): q/k/v `ColwiseParallel()` (each rank's heads, local
tensors), o `RowwiseParallel()`. `sinks` is one learned logit per head (a Parameter [HEADS], left out
of the plan: replicated); each query's softmax runs over its keys AND its head's sink, and the sink's
share is dropped (it only soaks up probability). At TP > 1 a rank holds HEADS/TP of the heads, so it
must use its own heads' sinks - and each rank's sink grad then covers its own heads only, so the
user sums the sink grads over the ranks in a hook. Vocab 32, hidden 32, 4 heads of 8, seq 8.

  sinks_first     the mistake: the sinks sliced to fit the local heads with `self.sinks[:n_local]`
                  (the first heads' sinks: the shape error goes away) - at TP=2 rank 1's heads 2, 3
                  use the sinks of heads 0, 1.                                              BUG
  sinks_unsynced  the sinks of the rank's own heads, but the hook that sums their grads forgotten:
                  the forward exact, each rank steps its replica of `sinks` with the grad of its own
                  heads only (zero for the others').                                        BUG
  sinks_ok        the twin: the rank's own heads' sinks, their grads summed over the ranks. rounding
    tpdiag compare --model py:tests/models/planted/attn_sinks.py:sinks_first --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 32, 32, 4, 2, 8
HEAD_DIM = HIDDEN // HEADS


def _tp():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GptOssAttention(nn.Module):
    def __init__(self, sink_slice, sync_sink_grads):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.sink_slice = sink_slice
        if sync_sink_grads:
            self.sinks.register_hook(self._sum_over_ranks)

    @staticmethod
    def _sum_over_ranks(g):
        if _tp()[1] > 1:
            g = g.clone()
            dist.all_reduce(g)
        return g

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, HEAD_DIM)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        n_local = q.shape[1]
        if self.sink_slice == "first":
            sinks = self.sinks[:n_local]
        else:
            rank = _tp()[0]
            sinks = self.sinks[rank * n_local:(rank + 1) * n_local]
        scores = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5
        causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        sink_col = sinks.view(1, -1, 1, 1).expand(bsz, -1, q_len, 1)
        logits = torch.cat([scores, sink_col], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        out = (probs @ v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class Block(nn.Module):
    def __init__(self, sink_slice, sync_sink_grads):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.self_attn = GptOssAttention(sink_slice, sync_sink_grads)

    def forward(self, x):
        return x + self.self_attn(self.input_layernorm(x))


class SinkLM(nn.Module):
    def __init__(self, sink_slice, sync_sink_grads):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(sink_slice, sync_sink_grads)])
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


PLAN = {
    "layers.*.self_attn.q_proj": ColwiseParallel(),
    "layers.*.self_attn.k_proj": ColwiseParallel(),
    "layers.*.self_attn.v_proj": ColwiseParallel(),
    "layers.*.self_attn.o_proj": RowwiseParallel(),
}


def _tokens(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _target(sink_slice, sync_sink_grads):
    return tpdiag.Target(model=SinkLM(sink_slice, sync_sink_grads), plan=PLAN, vocab_size=VOCAB,
                         inputs=_tokens)


def sinks_first():
    return _target("first", sync_sink_grads=True)


def sinks_unsynced():
    return _target("own", sync_sink_grads=False)


def sinks_ok():
    return _target("own", sync_sink_grads=True)
