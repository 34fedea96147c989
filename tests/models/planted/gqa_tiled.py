"""A pretraining team's torchtitan-shaped Llama (helper hnew22pt): `Transformer.forward(tokens)`,
`tok_embeddings` / `layers.N` / `norm` / `output`, its own RMSNorm class, complex `freqs_cis` RoPE,
GQA (4 query heads, 2 kv heads), SwiGLU, and torchtitan's TP plan with sequence parallelism
(`SequenceParallel` norms, `PrepareModuleInput` before attention and MLP) and a loss-parallel head
(`Shard(-1)` DTensor logits). Vocab 64, dim 32, 2 layers.

  interleaved  kv heads repeated with `repeat_interleave` (k0 k0 k1 k1), as torchtitan's repeat_kv:
               correct at every degree.                                                  rounding
  tiled        kv heads repeated with `.repeat` (k0 k1 k0 k1). At TP=1 query head h reads kv head
               h % 2; at TP=2 each rank holds one kv head, so rank 0's query heads 0, 1 both read k0
               where TP=1's head 1 read k1. The degrees train different models.            BUG

On the 2-core CPU host (AVX-512) the first op that differs in `layers.0.attention` is the RoPE's
complex product (its k, one kv head a rank: 19 ULP, within rounding) - before the `repeat`.

    tpdiag compare --model py:tests/models/planted/gqa_tiled.py:tiled --tp 1,2
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

import tpdiag

DIM, N_LAYERS, N_HEADS, N_KV, VOCAB, FFN, MAXLEN = 32, 2, 4, 2, 64, 64, 32
BATCH, SEQ = 2, 8


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * fc).flatten(3).type_as(xq), torch.view_as_real(xk_ * fc).flatten(3).type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, tiled=False):
        super().__init__()
        self.tiled = tiled
        self.n_heads, self.n_kv_heads, self.head_dim = N_HEADS, N_KV, DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = xq.shape[2] // xk.shape[2]
        if self.tiled:  # k0 k1 k0 k1: query head h reads kv head h % n_kv - of the rank's own kv heads
            xk, xv = xk.repeat(1, 1, n_rep, 1), xv.repeat(1, 1, n_rep, 1)
        else:           # k0 k0 k1 k1: query head h reads kv head h // n_rep, as torchtitan's repeat_kv
            xk = xk.repeat_interleave(n_rep, dim=2)
            xv = xv.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, tiled=False):
        super().__init__()
        self.attention = Attention(tiled)
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, tiled=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // N_HEADS, MAXLEN), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(tiled) for i in range(N_LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def tp_plan(loss_parallel=True):
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    layer = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    plan.update({f"layers.*.{k}": v for k, v in layer.items()})
    return plan


def cross_entropy_loss(pred, labels):
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)


def interleaved():
    return tpdiag.Target(model=Transformer(), plan=tp_plan(), vocab_size=VOCAB, loss=cross_entropy_loss)


def tiled():
    return tpdiag.Target(model=Transformer(tiled=True), plan=tp_plan(), vocab_size=VOCAB, loss=cross_entropy_loss)
